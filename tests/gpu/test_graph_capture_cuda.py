"""GPU-only (skipped without CUDA): the decode CUDA graphs a stage will replay are captured at
start-up, so that serving steps capture nothing (a capture, with the Triton compiles of its
warm-up, held a serving step up for about a second). A tiny AR engine with the hidden-state
and embedding-fed variants captured up front, in float32: replays equal eager steps, the
same tokens. The tiny Qwen3-Omni thinker and talker stages in bfloat16 (their MoE layers can
be captured only on the grouped-GEMM path): their variants and the code predictor's buckets
are there after start-up, and concurrent requests through both capture nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage import SamplingParams
from omnistage.ar.inputs import StreamInput
from omnistage.layers import graph_capture
from omnistage.ar.engine import AREngine
from omnistage.ar.model_runner import capture_key
from omnistage.configs.schema import ARConfig, KVCacheConfig, SchedulerConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = [1, 2, 4, 8]


@pytest.fixture(autouse=True)
def no_tf32():
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = matmul


def count_captures(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every CUDA graph capture from now on (decode and code predictor graphs), counted."""
    real = graph_capture.capture_graph
    calls: list[int] = []

    def counted(fn, pool):  # type: ignore[no-untyped-def]
        calls.append(len(calls))
        return real(fn, pool)

    monkeypatch.setattr(graph_capture, "capture_graph", counted)
    return calls


def make_engine(path: Path, enforce_eager: bool) -> AREngine:
    return AREngine(ARConfig(model=str(path), device="cuda", dtype="float32",
                             enforce_eager=enforce_eager, kv_cache=KVCacheConfig(num_blocks=256),
                             scheduler=SchedulerConfig(max_num_seqs=SIZES[-1],
                                                       max_num_batched_tokens=96)))


def serve(engine: AREngine, variant: str) -> dict[str, list]:
    """Requests emitting hidden states ("hidden") or fed stream embeddings, then a pad
    ("embeds"), joining in waves: decode steps of 1, 2, 3 and 7-8 rows (every bucket).
    -> request id -> [(token ids, logprobs, hidden states)] per step output."""
    gen = torch.Generator().manual_seed(0)
    hidden = engine.model_config.hidden_size
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3,
                            output_hidden_layers=[2, 1] if variant == "hidden" else [])
    got: dict[str, list] = {}

    def step() -> None:
        for o in engine.step():
            got.setdefault(o.request_id, []).append((o.new_token_ids, o.logprobs,
                                                     o.hidden_states))

    num = 0
    for size in (1, 1, 1, 5):
        for _ in range(size):
            rid, prompt = f"r{num}", [3 + num, 9, 11, 2 + num, 7]
            num += 1
            if variant == "hidden":
                engine.add_request(rid, prompt, params)
                continue
            engine.add_request(rid, prompt, params,
                               stream=StreamInput(pad=torch.randn(hidden, generator=gen)))
            engine.extend_request(rid, stream_embeds=torch.randn(6, hidden, generator=gen),
                                  close_stream=True)
        for _ in range(3):
            step()
    while engine.has_unfinished_requests:
        step()
    return got


@pytest.mark.parametrize("variant", ["hidden", "embeds"])
def test_variants_captured_at_start_up_equal_eager(tiny_qwen3: Path, variant: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    want = serve(make_engine(tiny_qwen3, enforce_eager=True), variant)
    calls = count_captures(monkeypatch)
    engine = make_engine(tiny_qwen3, enforce_eager=False)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.sizes == SIZES
    if variant == "hidden":
        engine.capture_decode_graphs((2, 1))
        key: tuple[tuple[int, ...], bool] = ((1, 2), False)
    else:
        engine.capture_decode_graphs(embeds=True)
        key = ((), True)
        assert graphs.embeds_ok and graphs.embeds is not None
        assert graphs.embeds.dtype == torch.float32
    assert {(bs, *key) for bs in SIZES} <= set(graphs.graphs)
    started, replays = len(calls), graphs.num_replays
    got = serve(engine, variant)
    assert len(calls) == started, "a serving step captured a graph"
    assert graphs.num_replays > replays
    assert set(got) == set(want)
    for rid in want:
        assert [g[0] for g in got[rid]] == [w[0] for w in want[rid]], rid
        for (_, lp, hidden), (_, ref_lp, ref_hidden) in zip(got[rid], want[rid]):
            for tok, value in (lp[0] if lp else {}).items():
                assert abs(value - ref_lp[0][tok]) < 1e-4, (rid, tok)
            for layer, h in (hidden or {}).items():
                torch.testing.assert_close(h, ref_hidden[layer], atol=1e-4, rtol=1e-4)


def test_qwen3_omni_stages_capture_at_start_up(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The thinker captures the variant of requests bound for the talker (layer 0 and
    accept_hidden_layer), the talker the embedding-fed one and every code predictor bucket;
    then three requests at once through thinker and talker (driven here in one thread as the
    orchestrator drives them: the thinker's chunks fed to the talker, its end closing the
    talker's input) capture nothing. (Not through Omni's in-process backend: there stages
    start in threads, and one stage's check for host synchronisation, torch's process-wide
    sync-debug mode, fails another's weight loading.)"""
    from omnistage.configs.defaults import resolve_graph
    from omnistage.stages.adapters import StageFeed
    from omnistage.models.qwen3_omni.moe import _use_grouped_mm
    from omnistage.models.qwen3_omni.processing import InputProcessor
    from omnistage.stages.interface import StageRequest
    from omnistage.stages.qwen3_omni import TalkerStage, ThinkerStage
    from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

    if not _use_grouped_mm(torch.zeros(1, 8, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("off the grouped-GEMM path (bf16, Hopper) the MoE layers synchronise "
                    "with the host: no decode graphs")
    ckpt = build_tiny_qwen3_omni(tmp_path / "omni")
    overrides = [f"{name}.{item}" for name in ("thinker", "talker")
                 for item in ("ar.max_num_seqs=4", "ar.kv_cache.num_blocks=256")]
    graph = resolve_graph(str(ckpt), ckpt, None, overrides, dtype="bfloat16")
    calls = count_captures(monkeypatch)
    thinker = ThinkerStage(graph.stage("thinker"), str(ckpt), "cuda")
    talker = TalkerStage(graph.stage("talker"), str(ckpt), "cuda")
    sizes = [1, 2, 4]
    graphs = thinker.engine.runner.graphs
    assert graphs is not None
    assert {(bs, capture_key(thinker.talker_layers), False) for bs in sizes} <= set(graphs.graphs)
    graphs = talker.engine.runner.graphs
    assert graphs is not None and graphs.embeds_ok
    assert {(bs, (), True) for bs in sizes} <= set(graphs.graphs)
    predictor = talker.model.code_predictor.graphs
    assert predictor is not None
    assert set(predictor.graphs) == {(bs, greedy) for bs in sizes for greedy in (True, False)}
    started = len(calls)
    assert started > 0

    processor = InputProcessor.from_pretrained(ckpt)
    texts = ("Hello world, what is the weather today?", "Tell me a story.", "Two plus two?")
    for i, text in enumerate(texts):
        ids = processor.parse_request({"messages": [{"role": "user", "content": text}]})
        thinker.add(StageRequest(f"r{i}", 0.0, SamplingParams(temperature=0.0, max_tokens=12),
                                 prompt_token_ids=ids.input_ids.tolist(),
                                 downstream=("talker",)))
        talker.add(StageRequest(f"r{i}", 0.0, SamplingParams(temperature=0.9, top_k=50,
                                                             max_tokens=30, seed=i),
                                streamed=True))
    frames = {f"r{i}": 0 for i in range(len(texts))}
    for _ in range(500):
        if not (thinker.has_unfinished_requests or talker.has_unfinished_requests):
            break
        for r in thinker.step():
            assert r.error is None, r.error
            if r.payload:
                talker.feed(r.request_id, StageFeed(payload=r.payload))
            if r.finished:
                talker.close_input(r.request_id)
        for r in talker.step():
            assert r.error is None, r.error
            frames[r.request_id] += int(r.payload.codec is not None)
    assert not talker.has_unfinished_requests
    assert len(calls) == started, "a serving step captured a graph"
    assert talker.engine.runner.graphs.num_replays > 0 and predictor.num_replays > 0
    assert all(frames.values()), frames
