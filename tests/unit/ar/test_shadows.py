"""Shadow sequences in the scheduler, with no model: scheduled with their owner, counted in
the token budget and the KV blocks, preempted, freed and aborted with it."""

from __future__ import annotations

import pytest
import torch

from omnistage.ar import shadows
from omnistage.ar.scheduler import Scheduler
from omnistage.ar.sequence import SequenceStatus
from omnistage.ar.scheduler import ScheduledBatch
from tests.unit.ar.test_scheduler import create_requests, create_scheduler

H = 4


def rows(n: int, value: float = 1.0) -> torch.Tensor:
    return torch.full((n, H), value)


def fake_step(s: Scheduler, token: int = 1) -> ScheduledBatch:
    """As the runner: shadows advance at the forward, the owners at the update."""
    batch = s.schedule()
    shadows.advance(batch.seqs, batch.num_new_tokens)
    s.update(batch, [token if batch.samples(i) else None for i in range(len(batch.seqs))])
    return batch


def used_blocks(s: Scheduler) -> int:
    return s.block_manager.num_blocks - s.block_manager.num_free_blocks


def test_shadows_run_in_the_owners_step_and_never_sample() -> None:
    s = create_scheduler(max_num_batched_tokens=32)
    a, b = create_requests(2, prompt_len=5, max_tokens=4)
    neg = shadows.add_shadow(a, "neg", rows(2), H)
    tok = shadows.add_shadow(a, "tok", rows(1), H)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch.seqs == [a, neg, tok, b] and batch.num_new_tokens == [5, 2, 1, 5]
    assert [batch.samples(i) for i in range(4)] == [True, False, False, True]
    shadows.advance(batch.seqs, batch.num_new_tokens)
    s.update(batch, [1, None, None, 1])
    assert neg.num_computed_tokens == 2 and neg.num_output_tokens == 0
    batch = fake_step(s)                      # nothing fed: the shadows sit the step out
    assert batch.seqs == [a, b]
    shadows.feed(neg, rows(1))
    batch = fake_step(s)
    assert batch.seqs == [a, neg, b] and batch.num_new_tokens == [1, 1, 1]
    assert neg.num_tokens == neg.num_computed_tokens == 3
    assert fake_step(s).seqs == [a, b]
    assert a.is_finished and b.is_finished    # max_tokens=4
    assert not neg.block_table and not tok.block_table
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_shadow_rows_count_in_the_token_budget() -> None:
    s = create_scheduler(max_num_batched_tokens=8)
    (a,) = create_requests(1, prompt_len=10, max_tokens=2)
    shadows.add_shadow(a, "neg", rows(3), H)
    s.add(a)
    batch = fake_step(s)
    assert batch.num_new_tokens == [5, 3]     # 8 = 3 shadow rows + a chunk of the prompt
    batch = fake_step(s)
    assert batch.num_new_tokens == [5]
    assert a.num_output_tokens == 1


def test_admission_needs_blocks_for_the_shadows_too() -> None:
    s = create_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = create_requests(2, prompt_len=7, max_tokens=1)   # 2 blocks each
    shadows.add_shadow(b, "neg", rows(5), H)                # 2 more: 4 blocks for b
    s.add(a)
    s.add(b)
    batch = fake_step(s)
    assert batch.seqs == [a]                  # b with its shadow does not fit beside a
    batch = fake_step(s)
    assert batch.seqs[0] is b and len(batch.seqs) == 2
    assert used_blocks(s) == 0                # both finished (max_tokens=1)


def test_preempted_owner_recomputes_its_shadows() -> None:
    s = create_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    a, b = create_requests(2, prompt_len=4, max_tokens=8)
    neg = shadows.add_shadow(b, "neg", rows(3), H)
    s.add(a)
    s.add(b)
    fake_step(s)
    assert used_blocks(s) == 3                # a 1, b 1, its shadow 1
    for _ in range(6):
        batch = fake_step(s)
        if batch.preempted:
            break
    assert b in batch.preempted and b.status is SequenceStatus.PREEMPTED
    assert neg.num_computed_tokens == 0 and not neg.block_table
    while s.has_unfinished:
        batch = fake_step(s)
        if b in batch.seqs and neg in batch.seqs:
            assert batch.num_new_tokens[batch.seqs.index(neg)] == 3   # recomputed whole
    assert neg.num_computed_tokens == 0 and used_blocks(s) == 0


def test_abort_frees_the_shadows() -> None:
    s = create_scheduler()
    (a,) = create_requests(1, prompt_len=6, max_tokens=5)
    neg = shadows.add_shadow(a, "neg", rows(6), H)
    s.add(a)
    fake_step(s)
    assert neg.block_table
    s.abort(a.request_id)
    assert not neg.block_table and used_blocks(s) == 0


def test_rollback_and_restart() -> None:
    s = create_scheduler(block_size=4)
    (a,) = create_requests(1, prompt_len=3, max_tokens=9)
    neg = shadows.add_shadow(a, "neg", torch.arange(5 * H, dtype=torch.float).view(5, H), H)
    s.add(a)
    fake_step(s)
    shadows.rollback(neg, 2)                  # computed rows dropped: written again
    assert neg.num_tokens == neg.num_computed_tokens == 3
    assert torch.equal(neg.prompt.embeds[-1], torch.arange(8, 12, dtype=torch.float))
    shadows.feed(neg, rows(1, 7.0))
    assert fake_step(s).num_new_tokens == [1, 1]
    blocks = list(neg.block_table)
    shadows.restart(neg, rows(2))
    assert neg.num_tokens == 2 and neg.num_computed_tokens == 0 and neg.last_hidden is None
    assert fake_step(s).num_new_tokens == [1, 2]
    assert neg.block_table == blocks          # its blocks are reused, none leak
    with pytest.raises(ValueError, match="roll back"):
        shadows.rollback(neg, 3)
    with pytest.raises(ValueError, match="already has"):
        shadows.add_shadow(a, "neg", rows(1), H)
    with pytest.raises(ValueError, match="shape"):
        shadows.feed(neg, rows(1)[0], H)
