"""Step caching, TeaCache-style: skip the transformer blocks on steps where their input has
barely changed, and reuse the residual they added last time.

Per request and per branch (conditional / unconditional: they drift differently), the engine
keeps a `StepCacheState`. Each step the model computes the modulated input of its first block
(cheap), and `decide` accumulates its relative L1 change since the previous step, rescaled
by a per-model polynomial (fitted so that it tracks the change of the blocks' output). While
the accumulated change stays under the request's threshold, the blocks are skipped and
`input + cached residual` stands in for their output; otherwise they run, the residual is
refreshed and the accumulator resets. The first and last steps always run.

On a stage split over ranks (issue 18) the ranks that run one model together (tensor- and
sequence-parallel) must skip together, or one would wait in a collective the others never
reach: the change is summed over the sequence shards (each rank holds only its tokens; ranks
holding the same tokens scale both sums alike) and the decision is taken only where every
rank of those groups takes it. CFG-parallel ranks run different branches, whose decisions
are their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from omnistage.layers.groups import stage_ranks


@dataclass(slots=True)
class StepCacheState:
    prev_modulated: Tensor | None = None
    residual: Tensor | None = None     # blocks' output - blocks' input, last computed step
    accumulated: float = 0.0
    num_skipped: int = 0


def rescale(rel_l1: float, coefficients: tuple[float, ...]) -> float:
    """The model's polynomial (highest power first, as numpy.polyval)."""
    out = 0.0
    for c in coefficients:
        out = out * rel_l1 + c
    return out


@dataclass(slots=True)
class CacheGroup:
    """Rows of one request's branch in a batch: they skip or compute together."""
    rows: slice
    state: StepCacheState
    threshold: float | None
    force_compute: bool
    length: int | None = None          # real tokens per row when the batch is padded


def cache_groups(requests: list, counts: list[int], branches: list[tuple[str, list[bool]]]
                 ) -> list[CacheGroup]:
    """Groups for a batch laid out branch after branch (e.g. all conditional rows, then the
    unconditional rows of requests with CFG): `branches` = (name, which requests have rows in
    it), requests in order, each contributing its `counts` rows."""
    groups, start = [], 0
    for name, present in branches:
        for r, n, here in zip(requests, counts, present):
            if here:
                groups.append(CacheGroup(slice(start, start + n),
                                         r.cache.setdefault(name, StepCacheState()),
                                         r.params.cache_threshold, r.must_compute))
                start += n
    return groups


def _change(prev: Tensor | None, modulated: Tensor) -> Tensor:
    """(sum |modulated - prev|, sum |prev|) over this rank's tokens, float32; zeros if none."""
    if prev is None or prev.shape != modulated.shape:
        return modulated.new_zeros(2, dtype=torch.float32)
    return torch.stack([(modulated.float() - prev.float()).abs().sum(), prev.float().abs().sum()])


def decide(groups: list[CacheGroup], modulated: list[Tensor],
           coefficients: tuple[float, ...]) -> list[bool]:
    """Skip (True) or compute each group this step, and update its state (not the residual):
    the relative L1 change of its modulated input, rescaled, accumulates while it stays under
    the threshold. The same answer on every rank of this model's groups (module docstring)."""
    if not groups:
        return []
    stats = torch.stack([_change(g.state.prev_modulated, m) for g, m in zip(groups, modulated)])
    ranks = stage_ranks()
    for axis in (ranks.ulysses, ranks.ring):              # the token shards' sums
        if axis.world_size > 1:
            dist.all_reduce(stats, group=axis.group)
    wants, totals = [], []
    for g, (num, den) in zip(groups, stats.tolist()):
        s = g.state
        usable = not (g.threshold is None or g.force_compute or s.prev_modulated is None
                      or s.residual is None)
        total = s.accumulated + rescale(num / max(den, 1e-12), coefficients) if usable else 0.0
        wants.append(usable and total < g.threshold)
        totals.append(total)
    flags = torch.tensor(wants, dtype=torch.int32, device=stats.device)
    for axis in (ranks.tp, ranks.ulysses, ranks.ring):    # skip only where all ranks would
        if axis.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=axis.group)
    skip = [bool(f) for f in flags.tolist()]
    for g, m, s, total in zip(groups, modulated, skip, totals):
        g.state.prev_modulated = m
        g.state.accumulated = total if s else 0.0
        g.state.num_skipped += s
    return skip


def run_cached(x: Tensor, modulated: Tensor, groups: list[CacheGroup],
               coefficients: tuple[float, ...], run_blocks) -> Tensor:
    """The blocks' output for every row of `x` (B, N, D): groups whose input changed enough
    run `run_blocks(row_index) -> (len(index), N, D)` (one call for all of them) and refresh
    their residual; the others get `x + residual`. `modulated` is the first block's modulated
    input (B, N, D). With `length` set, only a group's first `length` tokens count (padded
    batches whose padding differs from step to step)."""
    def real(t: Tensor, g: CacheGroup) -> Tensor:
        return t[g.rows] if g.length is None else t[g.rows, :g.length]

    skip = decide(groups, [real(modulated, g) for g in groups], coefficients)
    out = x.clone()
    run = [g for g, s in zip(groups, skip) if not s]
    if run:
        idx = torch.cat([torch.arange(g.rows.start, g.rows.stop) for g in run]).to(x.device)
        h = run_blocks(idx)
        out[idx] = h
        for g in run:
            g.state.residual = real(out, g) - real(x, g)
    for g, s in zip(groups, skip):
        if s:
            if g.length is None:
                out[g.rows] = x[g.rows] + g.state.residual
            else:
                out[g.rows, :g.length] = x[g.rows, :g.length] + g.state.residual
    return out

