"""Runge-Kutta 4 (the 3/8 rule) over a flow-matching ODE dx/dt = v(t, x), t from 0 (noise) to
1 (data), as Qwen2.5-Omni's token2wav integrates its DiT (the reference's
`RungeKutta4ODESolver`, fixed grid: its interpolation between grid points never runs).

    times:     | t_0 = 0 | t_1 | ... | t_{N-1} = 1 |      N points, N - 1 steps
    step_idx:  |    0    |  1  | ... |                   step i moves x from t_i to t_{i+1}

    k1 = v(t, x)                      k2 = v(t + h/3, x + h k1 / 3)
    k3 = v(t + 2h/3, x + h (k2 - k1/3))   k4 = v(t + h, x + h (k1 - k2 + k3))
    x' = x + (k1 + 3 (k2 + k3) + k4) h / 8

Stateless as the other solvers here: the grid and the step index belong to the request, and
a batch may hold rows at different steps (step_idx (B,)).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

Velocity = Callable[[Tensor, Tensor], Tensor]     # (t 0-d, x) -> dx/dt


def sway_times(num_steps: int, sway_coefficient: float | None, device: torch.device | str,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """(num_steps,) grid from 0 to 1, swayed towards 0 (more steps near the noise) by
    t + s (cos(pi t / 2) - 1 + t) when s < 0."""
    if num_steps < 2:
        raise ValueError(f"num_steps={num_steps}: the grid needs at least 2 points")
    t = torch.linspace(0, 1, num_steps, device=device, dtype=dtype)
    if sway_coefficient is not None:
        t += sway_coefficient * (torch.cos(math.pi / 2 * t) - 1 + t)
    return t


def rk4_step(velocity: Velocity, times: Tensor, step_idx: int | Tensor, x: Tensor) -> Tensor:
    """x at times[step_idx + 1] from x at times[step_idx]: four velocity evaluations. With
    step_idx (B,), row b of x (B, ...) takes its own step, and velocity gets t (B,)."""
    steps = torch.as_tensor(step_idx)
    assert 0 <= int(steps.min()) and int(steps.max()) < times.shape[0] - 1, \
        f"step {step_idx} of {times.shape[0] - 1}"
    return rk4_update(velocity, times[step_idx], times[step_idx + 1], x)


def rk4_update(velocity: Velocity, t0: Tensor, t1: Tensor, x: Tensor) -> Tensor:
    """x at t1 from x at t0 (both () or (B,), a time per row): the step's four evaluations
    and their sum, from device tensors alone (no host sync), so that a CUDA graph can hold a
    whole step."""
    dt = t1 - t0                                              # () or (B,)
    h = dt.reshape(-1, *[1] * (x.dim() - 1)) if dt.dim() else dt
    k1 = velocity(t0, x)
    k2 = velocity(t0 + dt * (1 / 3), x + h * k1 * (1 / 3))
    k3 = velocity(t0 + dt * (2 / 3), x + h * (k2 - k1 * (1 / 3)))
    k4 = velocity(t1, x + h * (k1 - k2 + k3))
    return x + (k1 + 3 * (k2 + k3) + k4) * h / 8
