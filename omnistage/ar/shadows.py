"""Shadow sequences: extra LM contexts a request carries (VibeVoice's CFG negative context and
its token-CFG context), run by the scheduler in the same forward as their owner.

    owner  | prompt ............ | out out out ...            samples; the model's feedback
    shadow | rows fed by the stage's hook ...               hook reads shadow.last_hidden

A shadow is a `Sequence` of embedding rows only (placeholder ids, never prefix cached, never
sampled) held in `owner.shadows[key]`, not in the scheduler's queues. It shares its owner's
life: scheduled whenever the owner is (its owed rows first counted against the step's token
budget and the free KV blocks), preempted with it (recomputed from its kept rows), freed when
the owner finishes or is aborted. The hook (`CausalLM.feedback`) runs after the forward: it
reads each shadow's `last_hidden` (the final hidden state of its last row computed so far) and
decides what the shadows take next: `feed` rows, `rollback` rows fed speculatively that the
sampled token did not want, `restart` a context from nothing.
"""

from __future__ import annotations

from typing import Hashable

import torch
from torch import Tensor

from omnistage.ar.inputs import PromptInput
from omnistage.ar.kv_cache import BlockManager
from omnistage.ar.sequence import Sequence
from omnistage.sampling_params import SamplingParams


def add_shadow(owner: Sequence, key: Hashable, rows: Tensor, hidden: int) -> Sequence:
    """Attach a new shadow context to `owner`, fed `rows` (n, hidden) first."""
    if key in owner.shadows:
        raise ValueError(f"request {owner.request_id!r} already has a shadow {key!r}")
    shadow = Sequence(request_id=f"{owner.request_id}#shadow{len(owner.shadows)}",
                      prompt_token_ids=[], sampling_params=SamplingParams(max_tokens=1),
                      prompt=PromptInput(None, False, False, None), owner=owner)
    owner.shadows[key] = shadow
    feed(shadow, rows, hidden)
    return shadow


def feed(shadow: Sequence, rows: Tensor, hidden: int | None = None) -> None:
    """Rows (n, H) the shadow computes at its owner's next step."""
    if rows.dim() != 2 or (hidden is not None and rows.shape[1] != hidden):
        raise ValueError(f"shadow rows have shape {tuple(rows.shape)}, expected (n, {hidden})")
    embeds = shadow.prompt.embeds
    shadow.prompt.embeds = rows if embeds is None else torch.cat([embeds, rows.to(embeds)])
    shadow.prompt_token_ids.extend([0] * rows.shape[0])


def rollback(shadow: Sequence, n: int) -> None:
    """Forget the shadow's last n rows (computed or not): their KV slots are written again."""
    keep = shadow.num_tokens - n
    if n < 0 or keep < 0:
        raise ValueError(f"cannot roll back {n} of {shadow.num_tokens} rows")
    del shadow.prompt_token_ids[keep:]
    shadow.prompt.embeds = shadow.prompt.embeds[:keep] if keep else None
    shadow.num_computed_tokens = min(shadow.num_computed_tokens, keep)


def restart(shadow: Sequence, rows: Tensor | None = None) -> None:
    """The context starts over (its KV blocks are kept and written again), from `rows`."""
    rollback(shadow, shadow.num_tokens)
    shadow.last_hidden = None
    if rows is not None:
        feed(shadow, rows)


def owed(owner: Sequence) -> list[tuple[Sequence, int]]:
    """The owner's shadows with rows to compute, and how many."""
    return [(s, s.num_tokens - s.num_computed_tokens) for s in owner.shadows.values()
            if s.num_tokens > s.num_computed_tokens]


def blocks_needed(bm: BlockManager, owner: Sequence) -> int:
    return sum(bm.num_blocks_needed(s, n) for s, n in owed(owner))


def allocate(bm: BlockManager, owner: Sequence) -> list[tuple[Sequence, int]]:
    """Blocks for every owed shadow row (the caller checked `blocks_needed`) -> (shadow, n)."""
    rows = owed(owner)
    for s, n in rows:
        bm.allocate(s, n)
    return rows


def free(bm: BlockManager, owner: Sequence) -> None:
    """Drop the shadows' KV (the owner finished, or is preempted: then recomputed)."""
    for s in owner.shadows.values():
        bm.free(s)
        s.num_computed_tokens = 0


def record_hidden(seqs: list[Sequence], num_new_tokens: list[int], hidden: Tensor,
                  query_start_loc: list[int]) -> None:
    """After a forward (before the hook) over a batch's `seqs`: each shadow in it has computed
    its rows, and keeps its last row's final hidden state."""
    for i, seq in enumerate(seqs):
        if seq.owner is not None:
            # a copy: a graph-replayed step's rows are overwritten by the next replay
            seq.last_hidden = hidden[query_start_loc[i + 1] - 1].clone()
    advance(seqs, num_new_tokens)


def advance(seqs: list[Sequence], num_new_tokens: list[int]) -> None:
    """A batch's shadows computed their rows (at once: the hook may roll them back before
    the scheduler's `update`, which leaves shadows alone)."""
    for seq, n in zip(seqs, num_new_tokens):
        if seq.owner is not None:
            seq.num_computed_tokens += n
