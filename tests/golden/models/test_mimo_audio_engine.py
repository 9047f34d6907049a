"""MiMo-Audio's LLM on our paged AR engine (KV cache, the engine's sampler, the model's feedback
hook running the patch decoder and the patch encoder per step), golden against upstream
XiaomiMiMo/MiMo-Audio's MiMoAudioForCausalLM.generate through tests/fixtures/mimo_audio (commit
in tokens.json, scripts/mimo_audio_fixtures.py): the same text ids and audio ids, greedy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omnistage.ar.engine import AREngine
from omnistage.configs.schema import ARConfig, KVCacheConfig
from omnistage.models.mimo_audio.model import MiMoAudioForCausalLM
from omnistage.models.qwen3_omni.talker import FRAME_CODES
from omnistage.sampling_params import SamplingParams

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "mimo_audio"


@pytest.fixture(scope="module")
def fx() -> dict:
    return json.loads((FIXTURES / "tokens.json").read_text())


@pytest.fixture(scope="module")
def engine(fx: dict) -> AREngine:
    def load(path, device, dtype):
        model = MiMoAudioForCausalLM.from_pretrained(path, fx["args"]["empty_idx"], device,
                                                     dtype or torch.float32)
        return model, model.model_config, None
    return AREngine(ARConfig(model=str(FIXTURES / "tiny"), device="cpu", dtype="float32",
                             kv_cache=KVCacheConfig(block_size=4)), loader=load)


def _run(engine: AREngine, fx: dict, params: dict[str, SamplingParams]) -> dict[str, list]:
    """Each request: the fixture's prompt as patch embeddings -> per step (text id, codes)."""
    g, width = 4, 9
    with torch.no_grad():
        prompt = engine.model.patch_embeds(torch.tensor(fx["prompt"]).view(-1, g, width))
    for rid, p in params.items():
        engine.add_request(rid, None, p, prompt_embeds=prompt)
    got: dict[str, list] = {rid: [] for rid in params}
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.error is None, out.error
            for t in out.new_token_ids:
                got[out.request_id].append((t, None if out.extra is None
                                             else out.extra[FRAME_CODES]))
    # the model keeps its last token's extras (keeps_last_extras): the last patch is output
    return got


def _patches(steps: list, cfg) -> list[int]:
    """(text id, codes) per step (codes None: a text patch) -> upstream's flat layout (steps * 4 * 9,)."""
    empties = torch.tensor(cfg.empty_ids).expand(cfg.group_size, -1)
    rows = [torch.cat([torch.full((cfg.group_size, 1), t), empties if c is None else c], 1)
            for t, c in steps]
    return torch.stack(rows).reshape(-1).tolist()


def test_greedy_text_and_speech_match_upstream(fx: dict, engine: AREngine, monkeypatch) -> None:
    """free: upstream's greedy text; speak (a second engine run): the text id forced to
    <|empty|> as upstream's forced sampler, every step drawing a patch; two requests at once."""
    model, cfg = engine.model, engine.model.cfg
    greedy = SamplingParams(temperature=0.0, max_tokens=fx["steps"], ignore_eos=True)
    got = _run(engine, fx, {"a": greedy, "b": greedy})
    assert _patches(got["a"], cfg) == _patches(got["b"], cfg) == fx["free"]

    plain = model.compute_logits

    def forced(hidden):
        logits = plain(hidden)
        keep = logits[:, cfg.empty_idx].clone()
        logits.fill_(float("-inf"))[:, cfg.empty_idx] = keep
        return logits
    monkeypatch.setattr(model, "compute_logits", forced)
    got = _run(engine, fx, {"s": greedy, "t": greedy})
    assert _patches(got["s"], cfg) == _patches(got["t"], cfg) == fx["speak"]


def test_sampling_is_seeded_and_differs_from_greedy(fx: dict, engine: AREngine,
                                                      monkeypatch) -> None:
    model, cfg = engine.model, engine.model.cfg
    plain = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: plain(h).index_fill_(
        1, torch.tensor([i for i in range(cfg.llm.vocab_size) if i != cfg.empty_idx]),
        float("-inf")))
    hot = dict(temperature=1.5, max_tokens=3, ignore_eos=True)
    got = _run(engine, fx, {"x": SamplingParams(seed=7, **hot), "y": SamplingParams(seed=7, **hot),
                            "z": SamplingParams(seed=8, **hot)})
    x, y, z = (_patches(got[k], cfg) for k in "xyz")
    assert x == y != z
    assert x != fx["speak"][:len(x)]


def test_patches_decoded_together_equal_each_alone(engine: AREngine) -> None:
    """The feedback hook decodes every speech row of a step in one batch: each row's audio
    ids equal its own decode, greedy and with seeded draws (and a mix of both in one batch)."""
    from omnistage.models.mimo_audio.model import _drawer
    model = engine.model
    cfg = model.cfg
    x = torch.randn(3, model.hidden_states_downcast.weight.shape[0],
                    generator=torch.Generator().manual_seed(1))

    def seq(temperature: float, seed: int) -> object:
        class Seq:
            sampling_params = SamplingParams(temperature=temperature, top_k=5, seed=seed)
            generator = torch.Generator().manual_seed(seed)
        return Seq()
    with torch.no_grad():
        for temps in ((0.0, 0.0, 0.0), (0.9, 0.0, 1.2)):
            together = model.decode_patches(x, [_drawer(seq(t, 7 + i))
                                                for i, t in enumerate(temps)])
            alone = [model.decode_patch(x[i], _drawer(seq(t, 7 + i)))
                     for i, t in enumerate(temps)]
            assert together.shape == (3, cfg.group_size, cfg.audio_channels)
            assert all(torch.equal(together[i], a) for i, a in enumerate(alone)), temps
            assert len({tuple(a.flatten().tolist()) for a in alone}) == 3
