"""Scheduler tests with no model: a fake runner returns fixed tokens."""

from __future__ import annotations

from omnistage.ar.kv_cache import BlockManager
from omnistage.ar.scheduler import ScheduledBatch, Scheduler
from omnistage.ar.sequence import FinishReason, Sequence, SequenceStatus
from omnistage.configs.schema import SchedulerConfig
from omnistage.sampling_params import SamplingParams

EOS = 99


def create_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                     max_num_batched_tokens: int = 32, max_model_len: int = 128,
                     prefix_caching: bool = True, chunked: bool = True) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          enable_chunked_prefill=chunked)
    return Scheduler(cfg, bm, max_model_len)


def create_requests(num: int, prompt_len: int, max_tokens: int = 4, start: int = 0,
                    **params: object) -> list[Sequence]:
    return [Sequence(request_id=f"r{i}", prompt_token_ids=[(i * 7 + j) % 50 for j in range(prompt_len)],
                     sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, **params),
                     eos_token_ids=(EOS,))
            for i in range(start, start + num)]


def fake_step(s: Scheduler, token: int = 1) -> ScheduledBatch:
    batch = s.schedule()
    sampled = [token if batch.samples(i) else None for i in range(len(batch.seqs))]
    s.update(batch, sampled)
    return batch


def run_to_end(s: Scheduler, max_steps: int = 1000) -> int:
    steps = 0
    while s.has_unfinished and steps < max_steps:
        fake_step(s)
        steps += 1
    assert not s.has_unfinished, "scheduler did not drain"
    return steps


def test_token_budget_and_chunked_prefill() -> None:
    s = create_scheduler(max_num_batched_tokens=10)
    (long,) = create_requests(1, prompt_len=25)
    s.add(long)
    sizes = [fake_step(s).num_new_tokens[0] for _ in range(3)]
    assert sizes == [10, 10, 5]          # a 25-token prompt in three chunks
    assert long.num_output_tokens == 1   # sampled only when the last chunk ran
    assert fake_step(s).num_new_tokens == [1]


def test_prefill_chunks_mix_with_decodes() -> None:
    s = create_scheduler(max_num_batched_tokens=8)
    a, = create_requests(1, prompt_len=4, max_tokens=10)
    s.add(a)
    fake_step(s)                          # a prefilled, now decoding
    b, = create_requests(1, prompt_len=20, start=1)
    s.add(b)
    batch = fake_step(s)
    assert [q.request_id for q in batch.seqs] == ["r0", "r1"]
    assert batch.num_new_tokens == [1, 7]  # decode first, the rest of the budget to b's chunk
    assert batch.num_tokens <= 8


def test_max_num_seqs_and_fifo() -> None:
    s = create_scheduler(max_num_seqs=2)
    reqs = create_requests(4, prompt_len=3, max_tokens=2)
    for r in reqs:
        s.add(r)
    batch = s.schedule()
    assert [q.request_id for q in batch.seqs] == ["r0", "r1"]
    s.update(batch, [1, 1])
    run_to_end(s)
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    # FIFO: r2 started only after a seat freed, and before r3
    assert reqs[2].first_scheduled_time <= reqs[3].first_scheduled_time


def test_stop_conditions() -> None:
    s = create_scheduler()
    eos_req, = create_requests(1, prompt_len=3, max_tokens=10)
    s.add(eos_req)
    batch = s.schedule()
    s.update(batch, [EOS])
    assert eos_req.finish_reason is FinishReason.STOP and eos_req.output_token_ids == [EOS]

    ignore, = create_requests(1, prompt_len=3, max_tokens=2, start=1, ignore_eos=True)
    s.add(ignore)
    s.update(s.schedule(), [EOS])
    s.update(s.schedule(), [EOS])
    assert ignore.finish_reason is FinishReason.LENGTH and ignore.num_output_tokens == 2

    min_tok, = create_requests(1, prompt_len=3, max_tokens=5, start=2, min_tokens=2,
                               stop_token_ids=(7,))
    s.add(min_tok)
    s.update(s.schedule(), [7])          # too early to stop
    assert not min_tok.is_finished
    s.update(s.schedule(), [7])
    assert min_tok.finish_reason is FinishReason.STOP and min_tok.num_output_tokens == 2
    assert not s.has_unfinished
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_max_model_len_finishes_with_length() -> None:
    s = create_scheduler(max_model_len=10)
    req, = create_requests(1, prompt_len=8, max_tokens=100)
    s.add(req)
    run_to_end(s)
    assert req.finish_reason is FinishReason.LENGTH and req.num_tokens == 10


def test_preemption_newest_first_and_recompute() -> None:
    # 6 blocks of 4 tokens; three requests of 8 prompt tokens each need 2 blocks, then a third
    # block once they decode past 8 tokens: someone must be preempted.
    s = create_scheduler(num_blocks=6, block_size=4, prefix_caching=False)
    reqs = create_requests(3, prompt_len=8, max_tokens=6)
    for r in reqs:
        s.add(r)
    fake_step(s)
    assert all(r.status is SequenceStatus.RUNNING for r in reqs)
    batch = fake_step(s)
    assert [v.request_id for v in batch.preempted] == ["r2"]   # the newest
    assert reqs[2].status is SequenceStatus.PREEMPTED and reqs[2].num_computed_tokens == 0
    assert reqs[2].block_table == [] and reqs[2].num_output_tokens == 1   # tokens kept
    assert s.waiting[0] is reqs[2]
    run_to_end(s)
    assert all(r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 6 for r in reqs)
    assert s.num_preemptions >= 1 and s.block_manager.num_free_blocks == 6


def test_preempt_self_when_alone_cannot_grow() -> None:
    s = create_scheduler(num_blocks=4, block_size=4, prefix_caching=False, max_model_len=16)
    a, b = create_requests(2, prompt_len=7, max_tokens=8)
    s.add(a)
    s.add(b)
    run_to_end(s)
    assert a.num_output_tokens + b.num_output_tokens > 0
    assert all(r.is_finished for r in (a, b))
    assert s.block_manager.num_free_blocks == 4


def test_abort_any_moment_releases_blocks() -> None:
    s = create_scheduler(max_num_batched_tokens=6)
    a, b, c = create_requests(3, prompt_len=10, max_tokens=5)
    for r in (a, b, c):
        s.add(r)
    fake_step(s)                           # a mid-prefill, b and c waiting
    s.abort("r0")
    s.abort("r2")
    assert a.finish_reason is FinishReason.ABORT and a.block_table == []
    assert c.finish_reason is FinishReason.ABORT and c not in s.waiting
    assert s.abort("nope") is None
    run_to_end(s)
    assert b.finish_reason is FinishReason.LENGTH
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_abort_during_step_ignores_result() -> None:
    s = create_scheduler()
    a, = create_requests(1, prompt_len=3)
    s.add(a)
    batch = s.schedule()
    s.abort("r0")
    assert s.update(batch, [5]) == []
    assert a.output_token_ids == [] and a.finish_reason is FinishReason.ABORT


def test_prefix_hit_skips_computed_tokens() -> None:
    s = create_scheduler(block_size=4, max_num_batched_tokens=64)
    prefix = list(range(16))
    first = Sequence("a", prefix + [40, 41], SamplingParams(temperature=0, max_tokens=1))
    s.add(first)
    run_to_end(s)
    second = Sequence("b", prefix + [42, 43, 44], SamplingParams(temperature=0, max_tokens=1))
    s.add(second)
    batch = s.schedule()
    assert second.num_cached_tokens == 16
    assert batch.num_new_tokens == [3]     # only the tail is computed


def test_no_chunked_prefill_waits_for_room() -> None:
    s = create_scheduler(max_num_batched_tokens=8, chunked=False)
    a, = create_requests(1, prompt_len=4, max_tokens=5)
    s.add(a)
    fake_step(s)
    b, = create_requests(1, prompt_len=12, start=1)
    s.add(b)
    batch = fake_step(s)
    assert [q.request_id for q in batch.seqs] == ["r0"]   # b does not fit beside a decode
