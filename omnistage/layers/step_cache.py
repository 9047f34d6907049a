"""Step caching, TeaCache-style: skip the transformer blocks on steps where their input has
barely changed, and reuse the residual they added last time.

Per request and per branch (conditional / unconditional: they drift differently), the engine
keeps a `StepCacheState`. Each step the model computes the modulated input of its first block
(cheap), and `should_skip` accumulates its relative L1 change since the previous step, rescaled
by a per-model polynomial (fitted so that it tracks the change of the blocks' output). While
the accumulated change stays under the request's threshold, the blocks are skipped and
`input + cached residual` stands in for their output; otherwise they run, the residual is
refreshed and the accumulator resets. The first and last steps always run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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


def should_skip(state: StepCacheState, modulated: Tensor, threshold: float | None,
                coefficients: tuple[float, ...], force_compute: bool) -> bool:
    """Decide for one branch of one request and update its state (not the residual)."""
    prev, state.prev_modulated = state.prev_modulated, modulated
    if threshold is None or force_compute or prev is None or state.residual is None:
        state.accumulated = 0.0
        return False
    rel = float((modulated - prev).abs().mean() / prev.abs().mean().clamp_min(1e-12))
    state.accumulated += rescale(rel, coefficients)
    if state.accumulated < threshold:
        state.num_skipped += 1
        return True
    state.accumulated = 0.0
    return False


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


def run_cached(x: Tensor, modulated: Tensor, groups: list[CacheGroup],
               coefficients: tuple[float, ...], run_blocks) -> Tensor:
    """The blocks' output for every row of `x` (B, N, D): groups whose input changed enough
    run `run_blocks(row_index) -> (len(index), N, D)` (one call for all of them) and refresh
    their residual; the others get `x + residual`. `modulated` is the first block's modulated
    input (B, N, D). With `length` set, only a group's first `length` tokens count (padded
    batches whose padding differs from step to step)."""
    def real(t: Tensor, g: CacheGroup) -> Tensor:
        return t[g.rows] if g.length is None else t[g.rows, :g.length]

    skip = [should_skip(g.state, real(modulated, g), g.threshold, coefficients, g.force_compute)
            for g in groups]
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
