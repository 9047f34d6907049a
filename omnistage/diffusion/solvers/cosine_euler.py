"""Euler over a flow-matching ODE dx/dt = v(t, x) on a cosine-warped grid, t from 0 (noise) to
1 (data), as CosyVoice's flow integrates its DiT (the reference's `ConditionalCFM.solve_euler`
with t_scheduler 'cosine'):

    times:     | t_0 = 0 | t_1 | ... | t_N = 1 |     t_i = 1 - cos(pi/2 * i / N)
    step_idx:  |    0    |  1  | ... |              step i moves x from t_i to t_{i+1}

    x' = x + (t_{i+1} - t_i) v(t_i, x)

Stateless as the other solvers here: the grid and the step index belong to the request.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def cosine_times(num_steps: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> Tensor:
    """(num_steps + 1,) grid from 0 to 1, denser near the noise."""
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps}: at least one step")
    t = torch.linspace(0, 1, num_steps + 1, device=device, dtype=dtype)
    return 1 - torch.cos(t * 0.5 * math.pi)


def euler_update(x: Tensor, velocity: Tensor, t0: Tensor, t1: Tensor) -> Tensor:
    """x at t1 from x at t0 (() or (B,), a time per row) and the velocity at (t0, x)."""
    dt = t1 - t0
    h = dt.reshape(-1, *[1] * (x.dim() - 1)) if dt.dim() else dt
    return x + h * velocity
