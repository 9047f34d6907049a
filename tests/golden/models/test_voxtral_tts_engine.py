"""Voxtral-TTS on our paged AR engine (KV cache, forced logits, the generation head in the
feedback hook feeding each frame's packed embedding back) equals a plain loop over the same
parts without a cache (the backbone golden vs transformers, the head and the packed table
golden vs vLLM-Omni: test_voxtral_tts*.py): two requests with different seeds and cfg_alpha,
a voice prompt of 3 frames, the same frames step by step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.ar.engine import AREngine
from omnistage.configs.schema import ARConfig, KVCacheConfig
from omnistage.layers import graph_capture
from omnistage.models.mimo_audio.model import dense_forward
from omnistage.models.qwen3_omni.talker import FRAME_CODES
from omnistage.models.voxtral_tts.model import CFG_ALPHA, VoxtralTTSForCausalLM
from omnistage.sampling_params import SamplingParams
from omnistage.stages.voxtral_tts import head_graphs
from omnistage.testing.graph_emulation import rerun_capture

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "voxtral_tts" / "tiny"
STEPS = 5


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("voxtral")
    raw = load_file(TINY / "consolidated.safetensors")
    g = torch.Generator().manual_seed(0)
    raw["mm_audio_embeddings.tok_embeddings.weight"] = torch.randn(64, 32, generator=g)
    raw["norm.weight"] = 1 + 0.1 * torch.randn(32, generator=g)
    for i in range(2):
        for name, shape in [("attention.wq", (32, 32)), ("attention.wk", (16, 32)),
                            ("attention.wv", (16, 32)), ("attention.wo", (32, 32)),
                            ("feed_forward.w1", (48, 32)), ("feed_forward.w3", (48, 32)),
                            ("feed_forward.w2", (32, 48)), ("attention_norm", (32,)),
                            ("ffn_norm", (32,))]:
            w = torch.randn(shape, generator=g)
            raw[f"layers.{i}.{name}.weight"] = 1 + 0.1 * w if len(shape) == 1 else \
                w * 0.4 / shape[1] ** 0.5
    save_file(raw, out / "consolidated.safetensors")
    params = json.loads((TINY / "params.json").read_text())
    params.update(n_layers=2, head_dim=8, hidden_dim=48, n_heads=4, n_kv_heads=2,
                  norm_eps=1e-5, vocab_size=64, rope_theta=1e6)
    (out / "params.json").write_text(json.dumps(params))
    return out


def _prompt(model: VoxtralTTSForCausalLM) -> torch.Tensor:
    ids = torch.tensor([1, 25, 24, 24, 24, 35, 40, 41, 42, 36, 25])
    voice = torch.cat([torch.randint(2, 42, (3, 1), generator=torch.Generator().manual_seed(4)),
                       torch.randint(2, 23, (3, 6), generator=torch.Generator().manual_seed(5))],
                      1)
    with torch.no_grad():
        return model.prompt_embeds(ids, voice)


def _loop(model: VoxtralTTSForCausalLM, prompt: torch.Tensor, seed: int, alpha: float) -> list:
    gen, rows, frames = torch.Generator().manual_seed(seed), prompt, []
    with torch.no_grad():
        for _ in range(STEPS):
            h = dense_forward(model.model, rows[None])[0, -1:]
            frame = model.head(h, torch.tensor([alpha]), torch.randn(1, 6, generator=gen))
            if frame[0, 0] == 1:
                break
            frames.append(frame[0].tolist())
            rows = torch.cat([rows, model.audio_embedding(frame)])
    return frames


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_frames_equal_the_plain_loop(folder: Path, graphs: bool, monkeypatch) -> None:
    """graphs: the head replayed through the stage's RowGraphs (captures emulated on the CPU:
    `rerun_capture` reruns the captured function on the static buffers, so the rows' copy in,
    the bucket's padding and the copy out are what is tested)."""
    def load(path, device, dtype):
        model = VoxtralTTSForCausalLM.from_pretrained(path, device)
        return model, model.model_config, None
    engine = AREngine(ARConfig(model=str(folder), device="cpu", dtype="float32",
                               kv_cache=KVCacheConfig(block_size=4)), loader=load)
    model = engine.model
    if graphs:
        monkeypatch.setattr(graph_capture, "capture_graph", rerun_capture)
        model.head_graphs = head_graphs(model.head, 3, torch.device("cpu"), torch.float32)
        assert model.head_graphs is not None and sorted(model.head_graphs.graphs) == [1, 2, 3]
    prompt = _prompt(model)
    runs = {"a": (7, 1.2), "b": (8, 2.0)}
    for rid, (seed, alpha) in runs.items():
        engine.add_request(rid, None, SamplingParams(temperature=0.0, max_tokens=STEPS,
                                                     seed=seed, extra={CFG_ALPHA: alpha}),
                           prompt_embeds=prompt)
    got: dict[str, list] = {rid: [] for rid in runs}
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.error is None, out.error
            if out.extra is not None:
                got[out.request_id].append(out.extra[FRAME_CODES].tolist())
    for rid, (seed, alpha) in runs.items():
        want = _loop(model, prompt, seed, alpha)
        assert len(want) >= STEPS - 1 and len({tuple(f) for f in want}) > 1
        assert got[rid] == want[: len(got[rid])] and len(got[rid]) >= STEPS - 1
    assert got["a"] != got["b"]
    if graphs:
        assert model.head_graphs.num_replays >= STEPS - 1
