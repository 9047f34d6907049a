"""MiMo-Audio's patch decoder on tensors alone (models/mimo_audio/patch_graphs.py) and from its
graphs (stages/mimo_audio.patch_graphs, captures emulated on the CPU by `rerun_capture`: a
replay reruns the captured function on the static buffers, so the rows' copy in, the bucket's
padding and the copy out are what is tested), against the per-row draws of `decode_patches`
(the reference the upstream goldens pin: test_mimo_audio_engine.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.ar.engine import AREngine
from omnistage.configs.schema import ARConfig, KVCacheConfig
from omnistage.layers import graph_capture
from omnistage.models.mimo_audio.model import MiMoAudioForCausalLM, _drawer
from omnistage.models.mimo_audio.patch_graphs import decode_rows, row_sampling
from omnistage.models.qwen3_omni.talker import FRAME_CODES
from omnistage.sampling_params import SamplingParams
from omnistage.stages.mimo_audio import patch_graphs
from omnistage.testing.graph_emulation import rerun_capture

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "mimo_audio"
EMPTY_IDX = 7                     # any text id: the tests force <|empty|> to this one
PARAMS = {"greedy": SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
          "hot": SamplingParams(temperature=1.3, top_k=6, seed=7, max_tokens=5,
                                ignore_eos=True),
          "warm": SamplingParams(temperature=0.8, top_p=0.7, seed=8, max_tokens=4,
                                 ignore_eos=True),
          "unseeded": SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)}


class _Seq:
    def __init__(self, params: SamplingParams) -> None:
        self.sampling_params = params
        self.generator = (None if params.seed is None
                          else torch.Generator().manual_seed(params.seed))


@pytest.fixture(scope="module")
def engine() -> AREngine:
    def load(path, device, dtype):
        model = MiMoAudioForCausalLM.from_pretrained(path, EMPTY_IDX, device)
        return model, model.model_config, None
    engine = AREngine(ARConfig(model=str(FIXTURES / "tiny"), device="cpu", dtype="float32",
                               kv_cache=KVCacheConfig(block_size=4)), loader=load)
    model = engine.model
    plain = model.compute_logits

    def speak(hidden: torch.Tensor) -> torch.Tensor:     # every step draws a patch
        logits = plain(hidden)
        keep = logits[:, EMPTY_IDX].clone()
        logits.fill_(float("-inf"))[:, EMPTY_IDX] = keep
        return logits
    model.compute_logits = speak
    return engine


def test_tensor_draws_equal_the_per_row_draws(engine: AREngine) -> None:
    """decode_rows with noise pre-drawn from each row's generator (row_sampling) gives each
    seeded row the ids of its per-row draws (`_drawer`, fresh generators of the same seeds),
    greedy rows among them; the generators are left where the per-row draws leave them."""
    model = engine.model
    x = torch.randn(4, model.hidden_states_downcast.weight.shape[0],
                    generator=torch.Generator().manual_seed(1))
    order = ["hot", "greedy", "warm", "hot"]
    with torch.no_grad():
        for names in (order, ["greedy", "greedy"]):
            seqs = [_Seq(PARAMS[n]) for n in names]
            got = decode_rows(model, x[:len(names)], row_sampling(model, seqs, x.device))
            ref = [_Seq(PARAMS[n]) for n in names]
            want = model.decode_patches(x[:len(names)], [_drawer(s) for s in ref])
            assert torch.equal(got, want), names
            for s, r in zip(seqs, ref):
                if s.generator is not None:
                    assert torch.equal(s.generator.get_state(), r.generator.get_state())
        greedy = decode_rows(model, x)
        hot = decode_rows(model, x, row_sampling(model, [_Seq(PARAMS[n]) for n in order],
                                                 x.device))
    assert torch.equal(greedy[:2], got)
    assert not torch.equal(hot[0], greedy[0]) and not torch.equal(hot[2], greedy[2])
    assert torch.equal(hot[1], greedy[1])


def _run(engine: AREngine) -> dict[str, list]:
    """Four requests joining at steps 0, 1, 2 and 3 (batches of 1 to 4 speech rows); the
    unseeded one draws from the global generator, seeded here."""
    torch.manual_seed(0)
    hidden = engine.model.cfg.llm.hidden_size
    prompt = torch.randn(5, hidden, generator=torch.Generator().manual_seed(2)) * 0.5
    got: dict[str, list] = {rid: [] for rid in PARAMS}
    joins = {0: "greedy", 1: "unseeded", 2: "hot", 3: "warm"}
    step = 0
    while step in joins or engine.has_unfinished_requests:
        if step in joins:
            rid = joins[step]
            engine.add_request(rid, None, PARAMS[rid], prompt_embeds=prompt)
        for out in engine.step():
            assert out.error is None, out.error
            if out.extra is not None:
                got[out.request_id].append(out.extra[FRAME_CODES].tolist())
        step += 1
    return got


def test_engine_with_patch_graphs_equals_eager(engine: AREngine, monkeypatch) -> None:
    model = engine.model
    eager = _run(engine)
    assert all(len(v) == PARAMS[k].max_tokens for k, v in eager.items())
    assert len({str(v) for v in eager.values()}) == 4
    monkeypatch.setattr(graph_capture, "capture_graph", rerun_capture)
    graphs = patch_graphs(model, 4, torch.device("cpu"), torch.float32)
    assert graphs is not None       # 3 rows: padded to the bucket of 4
    assert sorted(graphs.greedy.graphs) == sorted(graphs.sampled.graphs) == [1, 2, 4]
    model.patch_graphs = graphs
    try:
        replayed = _run(engine)
    finally:
        model.patch_graphs = None
    assert replayed == eager
    # patch_graphs' own check replayed each once; the run: step 0 greedy, the rest sampled
    assert graphs.greedy.num_replays >= 1 + 1 and graphs.sampled.num_replays - 1 >= 5


def test_graphs_fall_back_to_eager_when_replay_differs(engine: AREngine, monkeypatch,
                                                       caplog) -> None:
    """A replay that differs from eager (here: a stand-in whose replay writes nothing back)
    leaves the decoder eager, with a warning."""
    def stale(fn, pool):
        fn()
        out = fn()

        class Graph:
            def replay(self) -> None:
                pass

            def pool(self) -> None:
                return None
        return Graph(), torch.full_like(out, -1)
    monkeypatch.setattr(graph_capture, "capture_graph", stale)
    assert patch_graphs(engine.model, 2, torch.device("cpu"), torch.float32) is None
    assert "without CUDA graphs" in caplog.text
