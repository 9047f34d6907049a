"""Continuous batching for the autoregressive engine.

Each step spends a token budget (`max_num_batched_tokens`) over at most `max_num_seqs` running
sequences. There is no prefill phase: every sequence owes `num_tokens - num_computed_tokens`
tokens, and a step gives each one as many as the budget allows, so long prompts are prefilled
in chunks next to decodes of other requests.

    schedule():  running (FIFO)  -> each gets min(owed, budget); out of blocks: preempt the
                                    newest running sequence (recompute later) and retry
                 waiting (FIFO)  -> admitted while budget, seats and blocks last, after a
                                    prefix-cache lookup; never in a step that preempted
    update():    num_computed_tokens += scheduled; register full blocks in the prefix cache;
                 append sampled tokens; finish on eos / stop ids / max_tokens / max_model_len
    schedule_ahead(batch):  the decode step after a batch not read yet (async scheduling),
                 when nothing else could be scheduled instead
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from omnistage.ar import shadows
from omnistage.ar.kv_cache import BlockManager
from omnistage.ar.sequence import FinishReason, Sequence, SequenceStatus
from omnistage.configs.schema import SchedulerConfig


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens computed this step, per seq
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def samples(self, i: int) -> bool:
        """Whether seqs[i] reaches its last token this step, so its logits give a new token."""
        seq = self.seqs[i]
        return (not seq.prompt.open and seq.owner is None
                and seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 max_model_len: int) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0

    # -- queue management ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        assert seq.request_id not in self.requests, seq.request_id
        assert seq.num_tokens < self.max_model_len, (seq.num_tokens, self.max_model_len)
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a request in any state (finished, stopped, aborted, failed) and free its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        shadows.free(self.block_manager, seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.requests[seq.request_id]

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.requests.get(request_id)
        if seq is not None:
            self.finish(seq, FinishReason.ABORT)
        return seq

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        idx = 0
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            num_new = min(seq.num_schedulable_tokens, budget - _shadow_tokens(seq))
            if num_new <= 0:  # waiting for upstream input; keeps its blocks
                idx += 1
                continue
            needed = bm.num_blocks_needed(seq, num_new) + shadows.blocks_needed(bm, seq)
            while needed > bm.num_free_blocks:
                victim = self.running.pop()  # the newest running sequence
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                if needed:
                    bm.allocate(seq, num_new)
                budget -= self._add(batch, seq, num_new)
                idx += 1

        while (self.waiting and budget > 0 and not batch.preempted
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if seq.num_computed_tokens == 0:
                bm.get_computed_blocks(seq)
            num_new = seq.num_schedulable_tokens
            budget -= _shadow_tokens(seq)
            if num_new == 0:  # nothing computable yet (a preempted, input-starved sequence)
                bm.free(seq)
                seq.num_computed_tokens = 0
                break
            if num_new > budget:
                if budget <= 0 or (not self.config.enable_chunked_prefill and self.running):
                    bm.free(seq)
                    seq.num_computed_tokens = 0
                    break
                num_new = budget
            if (bm.num_blocks_needed(seq, num_new) + shadows.blocks_needed(bm, seq)
                    > bm.num_free_blocks):
                bm.free(seq)  # undo a prefix-cache hit; try again next step
                seq.num_computed_tokens = 0
                break
            bm.allocate(seq, num_new)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            budget -= self._add(batch, seq, num_new) - _shadow_tokens(seq, batch)
        return batch

    def _add(self, batch: ScheduledBatch, seq: Sequence, num_new: int) -> int:
        """Put seq (its blocks allocated) and its owed shadow rows in the batch -> tokens."""
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        for shadow, n in shadows.allocate(self.block_manager, seq):
            batch.seqs.append(shadow)
            batch.num_new_tokens.append(n)
            num_new += n
        return num_new

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop the KV blocks, keep the tokens, requeue at the front."""
        self.block_manager.free(seq)
        shadows.free(self.block_manager, seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule_ahead(self, batch: ScheduledBatch, can_run: Callable[[list[Sequence]], bool]
                       ) -> tuple[ScheduledBatch, list[int]] | None:
        """The decode step after `batch` (launched, not read yet) for the same sequences, if
        nothing else could be scheduled instead: no request waits, every running sequence is
        in it, none is certain to finish now (max_tokens, the model's length), `can_run`
        takes them, and their next positions get blocks without preempting (allocated here).
        -> (that batch, the rows of `batch` it keeps), or None."""
        if self.waiting:
            return None
        keep = [i for i, s in enumerate(batch.seqs) if not s.is_finished]
        seqs = [batch.seqs[i] for i in keep]
        if not seqs or len(seqs) != len(self.running) or any(s.shadows for s in seqs):
            return None
        for seq in seqs:
            max_tokens = seq.sampling_params.max_tokens
            if ((max_tokens is not None and seq.num_output_tokens + 1 >= max_tokens)
                    or seq.num_tokens + 1 >= self.max_model_len):
                return None
        if not can_run(seqs):
            return None
        bm = self.block_manager
        if sum(bm.num_blocks_needed(s, 2) for s in seqs) > bm.num_free_blocks:
            return None
        for seq in seqs:                 # position num_computed + 1: the unread token's
            bm.allocate(seq, 2)
        return ScheduledBatch(seqs, [1] * len(seqs)), keep

    def update(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Advance the batch by what the runner computed; return sequences that finished.

        `sampled[i]` is the new token of batch.seqs[i], or None when it was mid-prompt.
        """
        assert len(sampled) == len(batch.seqs), (len(sampled), len(batch.seqs))
        finished: list[Sequence] = []
        now = time.monotonic()
        bm = self.block_manager
        page = bm.block_size
        for seq, num_new, token_id in zip(batch.seqs, batch.num_new_tokens, sampled):
            if seq.is_finished or seq.owner is not None:
                continue        # aborted while the step ran; a shadow (shadows.advance)
            before = seq.num_computed_tokens
            seq.num_computed_tokens = done = before + num_new
            if done // page != before // page:   # a block filled up: hash it for reuse
                bm.cache_blocks(seq, done)
            if token_id is None:
                continue
            seq.output_token_ids.append(token_id)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._check_stop(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _check_stop(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.sampling_params
        num_out = seq.num_output_tokens
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in seq.eos_token_ids:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def _shadow_tokens(seq: Sequence, batch: ScheduledBatch | None = None) -> int:
    """Rows seq's shadows owe (None) / took in `batch` (already counted at admission)."""
    if batch is None:
        return sum(n for _, n in shadows.owed(seq))
    return sum(n for s, n in zip(batch.seqs, batch.num_new_tokens) if s.owner is seq)
