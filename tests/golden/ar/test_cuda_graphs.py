"""`DecodeGraphs` on CPU: everything but the capture itself. `capture_graph` is replaced by a
stand-in whose replay reruns the captured forward pass on the static buffers and copies its
outputs into the tensors the capture returned, and the attention is the Triton kernels in
Triton's interpreter (they read lengths and slots from the buffers, as a replayed graph does).
So the buffer handling (padding rows, buckets, variants captured lazily or up front, the
embedding-fed variant, hidden-state outputs) is checked against eager steps here; tests/gpu
checks real graphs. The interpreter must be on before `import torch`: the tests run in a child process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from omnistage.testing.interpreter import (INTERPRETING, patch_interpreter,  # noqa: E402
                                           run_in_interpreter)

from omnistage.ar import cuda_graphs  # noqa: E402
from omnistage.layers import graph_capture  # noqa: E402
from omnistage.testing.graph_emulation import rerun_capture  # noqa: E402
from omnistage.ar.engine import AREngine  # noqa: E402
from omnistage.ar.inputs import StreamInput  # noqa: E402
from omnistage.configs.schema import ARConfig, KVCacheConfig, SchedulerConfig  # noqa: E402
from omnistage.sampling_params import SamplingParams  # noqa: E402
from tests.helpers.ar_steps import assert_same, drive  # noqa: E402

HERE = INTERPRETING and not torch.cuda.is_available()
in_child = pytest.mark.skipif(not HERE, reason="runs in the interpreter child")
BLOCK_SIZE = 4

if HERE:
    patch_interpreter()


@pytest.mark.skipif(HERE or torch.cuda.is_available(), reason="the child itself / a real GPU")
def test_in_triton_interpreter() -> None:
    """Re-run this file with TRITON_INTERPRET=1 in a child process (CPU only)."""
    run_in_interpreter(__file__)


_capture = rerun_capture    # the warm-up, then the run CUDA would only record


def make_engine(path: Path, graphs: bool, max_num_seqs: int = 8,
                async_scheduling: bool = True) -> AREngine:
    from omnistage.layers.triton_attention import TritonPagedAttention

    engine = AREngine(ARConfig(
        model=str(path), device="cpu", dtype="float32", async_scheduling=async_scheduling,
        kv_cache=KVCacheConfig(block_size=BLOCK_SIZE, num_blocks=40),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64)))
    runner = engine.runner
    layout = engine.kv_layout
    group = runner.attn_layers[0].num_heads // layout.num_kv_heads
    runner.backend = TritonPagedAttention(BLOCK_SIZE, group, layout.num_kv_heads, num_sms=8)
    for layer in runner.attn_layers:
        layer.backend = runner.backend
    if graphs:
        runner.graphs = cuda_graphs.DecodeGraphs(
            engine.model, runner.backend, BLOCK_SIZE, max_num_seqs, 32, torch.device("cpu"),
            False)
    return engine


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graph_capture, "capture_graph", _capture)


@in_child
def test_decode_graphs_equal_eager_as_requests_come_and_go(emulated, tiny_qwen3: Path) -> None:
    """Waves of requests: buckets are captured lazily after other buckets replayed and after
    finished requests' blocks went to new ones (a warm-up that wrote K/V into the last
    replay's slots would corrupt them); padding rows; logprobs."""
    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)

    waves = [[(f"a{i}", list(range(3 + i, 9 + 2 * i)), params(6)) for i in range(3)],
             [("b0", [7, 8, 9, 10, 11], params(14))],
             [(f"c{i}", list(range(20 + i, 23 + 3 * i)), params(8 + i)) for i in range(4)]]
    want = drive(make_engine(tiny_qwen3, graphs=False), waves)
    engine = make_engine(tiny_qwen3, graphs=True)
    got = drive(engine, waves)
    assert_same(got, want)
    graphs = engine.runner.graphs
    assert graphs.num_replays > 10 and {2, 4, 8} <= {key[0] for key in graphs.graphs}


@in_child
def test_hidden_state_outputs_from_graphs(emulated, tiny_qwen3: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            output_hidden_layers=[1, 2])
    waves = [[("h0", [4, 5, 6, 7], params), ("h1", [9, 8, 7, 6, 5, 4], params)]]
    want = drive(make_engine(tiny_qwen3, graphs=False), waves)
    engine = make_engine(tiny_qwen3, graphs=True)
    assert_same(drive(engine, waves), want)
    assert any(key[1] == (1, 2) for key in engine.runner.graphs.graphs)


@in_child
def test_embedding_fed_decodes_use_the_graphs(emulated, tiny_qwen3: Path) -> None:
    """Stream embeddings added to the decode inputs, then a pad once the stream closed: the
    embedding-fed variant, equal to eager."""
    gen = torch.Generator().manual_seed(0)
    hidden = 64
    streams = [(torch.randn(6, hidden, generator=gen), torch.randn(hidden, generator=gen))
               for _ in range(3)]

    def run(graphs: bool) -> tuple[dict[str, list], AREngine]:
        engine = make_engine(tiny_qwen3, graphs)
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
        got: dict[str, list] = {}
        for i, (stream, pad) in enumerate(streams):
            engine.add_request(f"s{i}", [5 + i, 9, 11, 2 + i], params,
                               stream=StreamInput(pad=pad))
            engine.extend_request(f"s{i}", stream_embeds=stream, close_stream=True)
            for _ in range(2):
                for o in engine.step():
                    got.setdefault(o.request_id, []).append((o.new_token_ids, o.logprobs, None))
        while engine.has_unfinished_requests:
            for o in engine.step():
                got.setdefault(o.request_id, []).append((o.new_token_ids, o.logprobs, None))
        return got, engine

    want, _ = run(False)
    got, engine = run(True)
    assert_same(got, want)
    graphs = engine.runner.graphs
    assert graphs.embeds_ok and {key[0] for key in graphs.graphs if key[2]} >= {1, 2, 4}


def _counted(monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> list[int]:
    """Capture with the stand-in (or fail), counting the captures."""
    calls: list[int] = []

    def capture(fn, pool):  # type: ignore[no-untyped-def]
        calls.append(len(calls))
        if fail:
            raise RuntimeError("capture failed")
        return _capture(fn, pool)

    monkeypatch.setattr(graph_capture, "capture_graph", capture)
    return calls


def _serve(engine: AREngine, variant: str, waves: list[int]) -> tuple[dict[str, list], set[int]]:
    """Requests of one variant (hidden-state outputs, or fed stream embeddings then a pad) in
    waves of the given sizes, a few steps apart, to the end: -> outputs as `drive` collects
    them, and the batch sizes of the decode steps replayed from graphs."""
    sizes: set[int] = set()
    graphs = engine.runner.graphs
    if graphs is not None:
        run = graphs.run

        def counted(inputs, *args):  # type: ignore[no-untyped-def]
            out = run(inputs, *args)
            if out is not None:
                sizes.add(inputs.num_seqs)
            return out
        graphs.run = counted  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    hidden = engine.model_config.hidden_size
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2,
                            output_hidden_layers=[2, 1] if variant == "hidden" else [])
    got: dict[str, list] = {}
    num = 0
    for size in waves:
        for _ in range(size):
            rid, prompt = f"r{num}", [3 + num, 9, 11, 2 + num]
            num += 1
            if variant == "hidden":
                engine.add_request(rid, prompt, params)
                continue
            engine.add_request(rid, prompt, params,
                               stream=StreamInput(pad=torch.randn(hidden, generator=gen)))
            engine.extend_request(rid, stream_embeds=torch.randn(4, hidden, generator=gen),
                                  close_stream=True)
        for _ in range(3):
            for o in engine.step():
                got.setdefault(o.request_id, []).append((o.new_token_ids, o.logprobs,
                                                         o.hidden_states))
    while engine.has_unfinished_requests:
        for o in engine.step():
            got.setdefault(o.request_id, []).append((o.new_token_ids, o.logprobs,
                                                     o.hidden_states))
    return got, sizes


@in_child
@pytest.mark.parametrize("variant", ["hidden", "embeds"])
def test_variant_captured_at_start_up(variant: str, tiny_qwen3: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`AREngine.capture_decode_graphs` captures every bucket of a variant (hidden layers
    given in any order, as ModelRunner.execute keys them; or fed embeddings, its buffer
    allocated in the model's hidden size and dtype) largest first; steps at every batch size
    then replay them, capture nothing, and equal eager steps."""
    calls = _counted(monkeypatch)
    engine = make_engine(tiny_qwen3, graphs=True)
    graphs = engine.runner.graphs
    if variant == "hidden":
        engine.capture_decode_graphs((2, 1, 2))
        key: tuple[tuple[int, ...], bool] = ((1, 2), False)
    else:
        engine.capture_decode_graphs(embeds=True)
        key = ((), True)
        assert graphs.embeds is not None and graphs.embeds.dtype == torch.float32
        assert graphs.embeds.shape == (8, engine.model_config.hidden_size)
    assert list(graphs.graphs) == [(bs, *key) for bs in (8, 4, 2, 1)]
    assert len(calls) == 4
    engine.capture_decode_graphs(*key)                    # captured already: nothing to do
    assert len(calls) == 4

    waves = [1, 1, 1, 5]                  # decode steps of 1, 2, 3 (bucket 4) and 8 rows
    got, sizes = _serve(engine, variant, waves)
    assert len(calls) == 4 and set(graphs.graphs) == {(bs, *key) for bs in (1, 2, 4, 8)}
    assert {next(b for b in graphs.sizes if b >= n) for n in sizes} == {1, 2, 4, 8}
    want, _ = _serve(make_engine(tiny_qwen3, graphs=False), variant, waves)
    assert_same(got, want)


@in_child
def test_variant_capture_failures(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An embedding-fed variant that fails to capture leaves those decodes eager (as when
    `run` fails to capture one); a hidden-state variant that fails raises; without graphs
    (CPU, enforce_eager) there is nothing to capture; a layer past the model's is refused."""
    engine = make_engine(tiny_qwen3, graphs=False)
    engine.capture_decode_graphs((1, 2), embeds=True)
    assert engine.runner.graphs is None
    calls = _counted(monkeypatch, fail=True)
    engine = make_engine(tiny_qwen3, graphs=True)
    graphs = engine.runner.graphs
    with pytest.raises(ValueError, match="layer 9"):
        engine.capture_decode_graphs((1, 9))
    engine.capture_decode_graphs(embeds=True)
    assert not graphs.embeds_ok and not graphs.graphs and len(calls) == 1
    engine.capture_decode_graphs(embeds=True)             # given up on: not tried again
    assert len(calls) == 1
    with pytest.raises(RuntimeError, match="capture failed"):
        engine.capture_decode_graphs((1,))
    _counted(monkeypatch)
    got, sizes = _serve(engine, "embeds", [2])
    assert not sizes and not any(key[2] for key in graphs.graphs)
    want, _ = _serve(make_engine(tiny_qwen3, graphs=False), "embeds", [2])
    assert_same(got, want)


@in_child
def test_capture_failing_with_pdl_is_retried_without(tiny_qwen3: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that fails while programmatic dependent launch is on is retried without it
    (and the graphs then replay as eager steps run); one that fails without it leaves the
    decodes eager instead of failing the stage."""
    from omnistage.layers import pdl

    seen: list[bool] = []

    def capture(fn, pool):  # type: ignore[no-untyped-def]
        seen.append(pdl.is_enabled())
        if pdl.is_enabled():
            raise RuntimeError("operation not permitted when stream is capturing")
        return _capture(fn, pool)

    monkeypatch.setattr(graph_capture, "capture_graph", capture)
    monkeypatch.setattr(pdl, "_on", True)
    # capture_all's check that the forward pass never syncs with the host: CUDA-only
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    engine = make_engine(tiny_qwen3, graphs=True)
    graphs = engine.runner.graphs
    assert graphs.capture_all()
    assert seen[0] and not any(seen[1:]) and not pdl.is_enabled()
    assert set(graphs.graphs) == {(bs, (), False) for bs in graphs.sizes}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    waves = [[(f"r{i}", list(range(4 + i, 10 + i)), params) for i in range(3)]]
    assert_same(drive(engine, waves), drive(make_engine(tiny_qwen3, graphs=False), waves))
    assert graphs.num_replays > 0

    def broken(fn, pool):  # type: ignore[no-untyped-def]
        raise RuntimeError("capture failed")

    monkeypatch.setattr(graph_capture, "capture_graph", broken)
    assert not make_engine(tiny_qwen3, graphs=True).runner.graphs.capture_all()


def _count_ahead(engine: AREngine) -> list[int]:
    """Batch sizes of the decode steps launched before the previous one was read."""
    sizes: list[int] = []
    launch = engine.runner.launch_decode

    def counted(batch, prev_tokens=None):  # type: ignore[no-untyped-def]
        if prev_tokens is not None:
            sizes.append(len(batch.seqs))
        return launch(batch, prev_tokens)
    engine.runner.launch_decode = counted  # type: ignore[method-assign]
    return sizes


@in_child
def test_async_scheduling_gives_the_same_outputs(emulated, tiny_qwen3: Path) -> None:
    """Decode steps launched before the previous step's tokens are read (fed them on the
    device) against the same graphs run step by step: the same tokens and logprobs, through
    requests arriving mid-pipeline, a stop token ending one mid-pipeline, seeded sampling,
    padding of the buckets, penalties and min_tokens (which count the unread token)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    probe = drive(make_engine(tiny_qwen3, graphs=True, async_scheduling=False),
                  [[("p", [3, 4, 5, 6], greedy)]])
    stop_at = probe["p"][4][0][0]                       # the 5th token it generates
    stop = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at])
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10,
                            ignore_eos=True, logprobs=1)
    penalised = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True,
                               repetition_penalty=1.3, frequency_penalty=0.4,
                               presence_penalty=0.3, logprobs=1)
    held = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=7,
                          stop_token_ids=[stop_at])      # the stop token banned until 7 out
    waves = [[("a", [3, 4, 5, 6], stop), ("b", [8, 9, 10], seeded)],
             [("c", [12, 13, 14, 15, 16], greedy), ("e", [3, 4, 5, 6], held)],
             [("d", [20, 21], penalised)]]
    want = drive(make_engine(tiny_qwen3, graphs=True, async_scheduling=False), waves, 4)
    engine = make_engine(tiny_qwen3, graphs=True)
    ahead = _count_ahead(engine)
    got = drive(engine, waves, 4)
    assert_same(got, want)
    assert got["a"][-1][0] == [stop_at] and len(got["a"]) == 5
    assert stop_at not in [t for step in got["e"][:6] for t in step[0]]
    assert len(ahead) > 5 and engine._inflight is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@in_child
def test_abort_while_a_step_is_in_flight(emulated, tiny_qwen3: Path) -> None:
    """An abort between steps leaves the launched step's row of that request unread; the
    others go on as without async scheduling; aborting everything drops the step."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs: dict[str, dict[str, list]] = {}
    for mode in (False, True):
        engine = make_engine(tiny_qwen3, graphs=True, async_scheduling=mode)
        ahead = _count_ahead(engine)
        got: dict[str, list] = {}
        for i in range(3):
            engine.add_request(f"r{i}", [3 + i, 7, 9], params)
        for n in range(20):
            if n == 4:
                assert engine.abort_request("r1") is not None
            for o in engine.step():
                got.setdefault(o.request_id, []).append(o.new_token_ids)
        outs[str(mode)] = got
        assert not engine.has_unfinished_requests and bool(ahead) == mode
    assert outs["True"] == outs["False"]
    assert len(outs["True"]["r0"]) == 10 and len(outs["True"]["r1"]) < 10

    engine = make_engine(tiny_qwen3, graphs=True)
    for i in range(2):
        engine.add_request(f"x{i}", [5, 6, 7], params)
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None
    for i in range(2):
        engine.abort_request(f"x{i}")
    assert engine.step() == [] and engine._inflight is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.add_request("y", [5, 6, 7], params)               # and the engine goes on
    got = drive(engine, [])
    assert [t for step in got["y"] for t in step[0]] == [
        t for step in drive(make_engine(tiny_qwen3, graphs=True, async_scheduling=False),
                            [[("y", [5, 6, 7], params)]])["y"] for t in step[0]]
