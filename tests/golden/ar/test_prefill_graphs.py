"""`PrefillGraphs` on CPU: steps with prompt rows (prefills, prefill chunks, decodes mixed in)
replayed from graphs, as the decode graphs' tests do it (test_cuda_graphs.py): the capture
is a stand-in whose replay reruns the forward pass on the static buffers, and the attention
is the Triton kernels in Triton's interpreter, reading the static work table, lengths and
slots as a replayed graph does. Every step is checked against the eager engine: tokens,
logprobs and hidden states, with prompts of odd lengths, chunked prompts, requests arriving
while others decode, prompts longer than the largest bucket (eager), prompts of embeddings
and hidden-state outputs. The interpreter must be on before `import torch`: the tests run in
a child process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from omnistage.testing.interpreter import (INTERPRETING, patch_interpreter,  # noqa: E402
                                           run_in_interpreter)

from omnistage.ar import cuda_graphs, prefill_graphs  # noqa: E402
from omnistage.ar.engine import AREngine  # noqa: E402
from omnistage.configs.schema import ARConfig, KVCacheConfig, SchedulerConfig  # noqa: E402
from omnistage.layers import graph_capture  # noqa: E402
from omnistage.sampling_params import SamplingParams  # noqa: E402
from omnistage.testing.graph_emulation import rerun_capture  # noqa: E402
from tests.helpers import ar_steps  # noqa: E402

HERE = INTERPRETING and not torch.cuda.is_available()
in_child = pytest.mark.skipif(not HERE, reason="runs in the interpreter child")
BLOCK_SIZE = 4
MAX_GRAPH_TOKENS = 40       # buckets 16, 32, 40; the scheduler's steps hold up to 48 tokens
CPU_DEVICE = torch.device("cpu")

if HERE:
    patch_interpreter()


@pytest.mark.skipif(HERE or torch.cuda.is_available(), reason="the child itself / a real GPU")
def test_in_triton_interpreter() -> None:
    """Re-run this file with TRITON_INTERPRET=1 in a child process (CPU only)."""
    run_in_interpreter(__file__)


def test_token_buckets() -> None:
    assert prefill_graphs.prefill_token_sizes(40) == [16, 32, 40]
    assert prefill_graphs.prefill_token_sizes(512) == [16, 32, 64, 128, 256, 512]
    assert prefill_graphs.prefill_token_sizes(1000) == [16, 32, 64, 128, 256, 512, 768, 1000]
    assert prefill_graphs.prefill_token_sizes(8) == [8]


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graph_capture, "capture_graph", rerun_capture)


def make_engine(path: Path, graphs: bool, max_num_seqs: int = 6) -> AREngine:
    from omnistage.layers.triton_attention import TritonPagedAttention

    engine = AREngine(ARConfig(
        model=str(path), device="cpu", dtype="float32",
        kv_cache=KVCacheConfig(block_size=BLOCK_SIZE, num_blocks=60),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=48)))
    runner = engine.runner
    layout = engine.kv_layout
    group = runner.attn_layers[0].num_heads // layout.num_kv_heads
    runner.backend = TritonPagedAttention(BLOCK_SIZE, group, layout.num_kv_heads, num_sms=8)
    for layer in runner.attn_layers:
        layer.backend = runner.backend
    if graphs:
        cpu = torch.device("cpu")
        runner.graphs = cuda_graphs.DecodeGraphs(
            engine.model, runner.backend, BLOCK_SIZE, max_num_seqs, 32, cpu, False)
        runner.prefill_graphs = prefill_graphs.PrefillGraphs(
            engine.model, runner.backend, BLOCK_SIZE, max_num_seqs, 32, MAX_GRAPH_TOKENS, cpu,
            False)
    return engine


def drive(engine: AREngine, waves: list[list[tuple]]) -> dict[str, list]:
    return ar_steps.drive(engine, waves, steps_between=2)


def assert_same(got: dict[str, list], want: dict[str, list]) -> None:
    ar_steps.assert_same(got, want, same_hidden_steps=True)


def params(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2, **kw)


@in_child
def test_prompt_steps_equal_eager_as_requests_come_and_go(emulated, tiny_qwen3: Path) -> None:
    """Prompts of 3 to 70 tokens (the longest chunked over two steps, both past the largest
    bucket: eager), arriving while earlier requests decode (mixed steps), after finished
    requests' blocks went to new ones; every bucket replayed; logprobs equal."""
    waves = [[("a0", list(range(3, 10)), params(5)), ("a1", list(range(2, 15)), params(7))],
             [("b0", list(range(5, 75)), params(4))],
             [(f"c{i}", list(range(20 + i, 25 + 3 * i)), params(6 + i)) for i in range(4)],
             [("d0", [9, 8, 7], params(3))]]
    want = drive(make_engine(tiny_qwen3, graphs=False), waves)
    engine = make_engine(tiny_qwen3, graphs=True)
    got = drive(engine, waves)
    assert_same(got, want)
    pg = engine.runner.prefill_graphs
    assert pg.num_replays >= 3
    assert {key[0] for key in pg.graphs} >= {16, 32}
    assert engine.runner.graphs.num_replays > 5           # the decode steps between


@in_child
def test_hidden_states_of_prompts_from_graphs(emulated, tiny_qwen3: Path) -> None:
    """A downstream stage's hidden rows of the prompt positions come out of the graph's
    output buffer (copied before the next replay overwrites it)."""
    p = params(4, output_hidden_layers=[1, 2])
    waves = [[("h0", [4, 5, 6, 7, 8], p), ("h1", list(range(9, 30)), p)],
             [("h2", list(range(3, 12)), p)]]
    want = drive(make_engine(tiny_qwen3, graphs=False), waves)
    engine = make_engine(tiny_qwen3, graphs=True)
    assert_same(drive(engine, waves), want)
    assert any(key[1] == (1, 2) for key in engine.runner.prefill_graphs.graphs)


@in_child
def test_prompts_of_embeddings_and_start_up_capture(emulated, tiny_qwen3: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`AREngine.capture_decode_graphs()` captures the prefill buckets of both prompt kinds
    (token ids, embeddings) up front, whatever its decodes are fed; prompts of embeddings then
    replay the embedding-fed variant and capture nothing more."""
    gen = torch.Generator().manual_seed(1)
    hidden = 64
    waves = [[("e0", torch.randn(9, hidden, generator=gen), params(5)),
              ("t0", list(range(4, 17)), params(5))],
             [("e1", torch.randn(23, hidden, generator=gen), params(4))]]
    want = drive(make_engine(tiny_qwen3, graphs=False), waves)
    engine = make_engine(tiny_qwen3, graphs=True)
    engine.capture_decode_graphs()
    pg = engine.runner.prefill_graphs
    keys = set(pg.graphs)
    assert keys == {(t, (), fed) for t in (16, 32, 40) for fed in (False, True)}
    calls = []
    real = pg._capture
    monkeypatch.setattr(pg, "_capture", lambda *key: calls.append(key) or real(*key))
    assert_same(drive(engine, waves), want)
    assert not calls and set(pg.graphs) == keys
    assert pg.num_replays >= 2


@in_child
def test_fed_capture_failure_leaves_those_prompts_eager(emulated, tiny_qwen3: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of embeddings whose graph cannot be captured runs eagerly, with the same
    outputs, and later ones of that variant do not try again; prompts of token ids still
    replay."""
    gen = torch.Generator().manual_seed(2)
    waves = [[("e0", torch.randn(7, 64, generator=gen), params(3))],
             [("t0", list(range(3, 12)), params(3))],
             [("e1", torch.randn(5, 64, generator=gen), params(3))]]
    want = drive(make_engine(tiny_qwen3, graphs=False), waves)
    engine = make_engine(tiny_qwen3, graphs=True)
    pg = engine.runner.prefill_graphs
    real = pg._capture
    refused = []

    def capture(tokens: int, capture: tuple[int, ...], embeds: bool) -> None:
        if embeds:
            refused.append(tokens)
            raise RuntimeError("capture refused")
        real(tokens, capture, embeds)

    monkeypatch.setattr(pg, "_capture", capture)
    assert_same(drive(engine, waves), want)
    assert pg.failed == {((), True)} and all(not key[2] for key in pg.graphs)
    assert refused == [16]      # e1's prompt did not try again
    assert pg.graphs            # t0's prompt replayed the token-id variant


def test_work_table_covers_every_batch() -> None:
    """The Triton backend's static plan: programs for every (sequence, query tile) of any
    batch within the bucket, padding programs on the padding sequence."""
    from omnistage.layers.triton_attention import TritonPagedAttention

    backend = TritonPagedAttention(16, num_queries_per_kv=2)
    step = 32                                   # 64-row tiles, 2 query heads a KV head
    top = backend.max_prefill_programs(100, 5)
    assert top == -(-100 // step) + 5
    qsl = [0, 1, 34, 35, 100]                   # a decode, 33 tokens, a decode, 65 tokens
    work = backend.prefill_work(qsl, top, pad_seq=4)
    seqs, firsts = work[:top], work[top:]
    real = [(s, f) for s, f in zip(seqs, firsts) if s != 4]
    assert real == [(0, 0), (1, 0), (1, 32), (2, 0), (3, 0), (3, 32), (3, 64)]
    assert len(seqs) == top and seqs.count(4) == top - len(real)
    with pytest.raises(AssertionError):
        backend.prefill_work([0, 100, 200], 3, pad_seq=2)


def test_mrope_positions_and_tables_land_in_the_buffers() -> None:
    """An M-RoPE model's (3, T) positions go to rows t, h, w of the static buffer (padding
    rows 0), with the ids, slots (padding -1), query starts (the end repeated), lengths (0
    past the batch), the work table and the block tables, as the captured graph reads them."""
    from omnistage.ar.step_plan import ForwardPlan
    from omnistage.layers.triton_attention import TritonPagedAttention
    from omnistage.utils.host import int_array, int_matrix_array

    backend = TritonPagedAttention(4, num_queries_per_kv=2)
    pg = prefill_graphs.PrefillGraphs(torch.nn.Identity(), backend, 4, max_num_seqs=3,
                                      max_blocks=8, max_tokens=32, device=CPU_DEVICE,
                                      mrope=True)
    positions = torch.tensor([[0, 1, 2, 7, 7], [0, 1, 2, 5, 6], [0, 1, 2, 4, 3]])
    plan = ForwardPlan(int_array([5, 6, 7, 8, 9]), positions, int_array([0, 1, 2, 17, 18]),
                       [0, 3, 5], [3, 9], int_matrix_array([[0], [3, 4, 5]], 3), 3, None,
                       None, (), [2, 4])
    assert pg.can_run(plan)
    pg._write_inputs(plan, 16)
    torch.testing.assert_close(pg.positions[:, :5], positions)
    assert not pg.positions[:, 5:].any()
    assert pg.input_ids[:6].tolist() == [5, 6, 7, 8, 9, 0]
    assert pg.slot_mapping[:6].tolist() == [0, 1, 2, 17, 18, -1]
    assert pg.query_start_loc.tolist() == [0, 3, 5, 5, 5]
    assert pg.seq_lens.tolist() == [3, 9, 0, 0]
    programs = pg.num_programs[16]
    work = pg._work(16).tolist()
    assert work[:programs][:2] == [0, 1] and set(work[2:programs]) == {2}    # padding: seq 2
    assert pg.block_tables[:2, :3].tolist() == [[0, 0, 0], [3, 4, 5]]
    too_wide = ForwardPlan(plan.input_ids, positions, plan.slot_mapping, [0, 3, 5], [3, 9],
                           int_matrix_array([[0], [1] * 9], 9), 9, None, None, (), [2, 4])
    assert not pg.can_run(too_wide)                      # tables wider than the buffers
