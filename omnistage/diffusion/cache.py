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
