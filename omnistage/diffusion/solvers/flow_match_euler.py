"""Flow-matching Euler: diffusers' `FlowMatchEulerDiscreteScheduler` as pure functions.

Convention (rectified flow, as in SD3, FLUX.1, Qwen-Image, Z-Image):

    x_t = t * noise + (1 - t) * x0         t = sigma in [0, 1]; t=1 is noise, t=0 is data
    v   = dx_t/dt = noise - x0             what the transformer predicts
    x_{t'} = x_t + (t' - t) * v            one Euler step from sigma_i to sigma_{i+1} < sigma_i

A schedule is `sigmas` (N+1,), decreasing and ending in 0 (1 if `invert_sigmas`); the model is fed
`timesteps = sigmas[:-1] * num_train_timesteps`.

    sigmas:    | s_0 = ~1 | s_1 | ... | s_{N-1} | 0 |
    step_idx:  |    0     |  1  | ... |   N-1   |      step i moves a row from s_i to s_{i+1}

Why stateless: diffusers' scheduler keeps `self._step_index` and bumps it in `step()`, so one
instance serves one request at a time. Here the schedule is a tensor the request owns and the
step index lives on the request, passed in as `(sigmas, step_idx)`. One batch can then hold
requests at different steps, and even with different schedules (sigmas (B, N+1), shorter ones
padded after their final 0).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class FlowMatchEulerConfig:
    """The fields of a diffusers `scheduler_config.json` for `FlowMatchEulerDiscreteScheduler`."""

    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    invert_sigmas: bool = False
    shift_terminal: float | None = None
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    time_shift_type: Literal["exponential", "linear"] = "exponential"
    stochastic_sampling: bool = False

    def __post_init__(self) -> None:
        if self.time_shift_type not in ("exponential", "linear"):
            raise ValueError(f"time_shift_type: {self.time_shift_type!r} is not "
                             "'exponential' or 'linear'")
        if self.use_karras_sigmas + self.use_exponential_sigmas + self.use_beta_sigmas > 1:
            raise ValueError("use_karras_sigmas, use_exponential_sigmas, use_beta_sigmas: "
                             "at most one may be set")
        if self.use_beta_sigmas:
            raise NotImplementedError("use_beta_sigmas: beta schedules are not supported")
        if self.stochastic_sampling:
            raise NotImplementedError("stochastic_sampling: only the deterministic step "
                                      "is supported")

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> FlowMatchEulerConfig:
        """Keeps our fields and drops the rest (`_class_name`, ...), as diffusers does."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_json(cls, path: str | Path) -> FlowMatchEulerConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                    base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """The `mu` of FLUX / Qwen-Image / Z-Image pipelines: linear in the number of image tokens."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def make_sigmas(cfg: FlowMatchEulerConfig, num_inference_steps: int, mu: float | None = None,
                sigmas: list[float] | np.ndarray | None = None,
                device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """-> (sigmas (N+1,), timesteps (N,)) float32, bit for bit what `set_timesteps` produces.

    `sigmas` are a pipeline's custom pre-shift sigmas (FLUX: `np.linspace(1, 1/N, N)`); `mu` is
    required with `use_dynamic_shifting` and ignored otherwise. The numpy dtypes follow diffusers
    (float64 for the default linspace, float32 for custom sigmas) so rounding matches too.
    """
    if cfg.use_dynamic_shifting and mu is None:
        raise ValueError("mu: required when use_dynamic_shifting is set")
    if sigmas is not None and len(sigmas) != num_inference_steps:
        raise ValueError(f"sigmas: {len(sigmas)} values for "
                         f"num_inference_steps={num_inference_steps}")
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps: {num_inference_steps} < 1")
    n_train = cfg.num_train_timesteps
    if sigmas is None:
        # diffusers' __init__ builds the 1000 training sigmas in torch float32 (shifted unless
        # dynamic) and spans the inference linspace between their ends, so a static shift is
        # applied to sigma_min twice. Both ends are recomputed here the same way.
        ends = torch.tensor([n_train, 1], dtype=torch.float32) / n_train
        if not cfg.use_dynamic_shifting:
            ends = cfg.shift * ends / (1 + (cfg.shift - 1) * ends)
        sigma_max, sigma_min = ends[0].item(), ends[1].item()
        s = np.linspace(sigma_max * n_train, sigma_min * n_train, num_inference_steps) / n_train
    else:
        s = np.array(sigmas).astype(np.float32)

    if cfg.use_dynamic_shifting:
        num = math.exp(mu) if cfg.time_shift_type == "exponential" else mu
        s = num / (num + (1 / s - 1))   # diffusers: (1/s - 1) ** 1.0, the same value
    else:
        s = cfg.shift * s / (1 + (cfg.shift - 1) * s)
    if cfg.shift_terminal:  # stretch so the last sigma is exactly shift_terminal (LTX-Video)
        one_minus_z = 1 - s
        if one_minus_z[-1] == 0:  # diffusers divides by zero here and returns NaN sigmas
            raise ValueError(f"shift_terminal: undefined when the last sigma is 1 "
                             f"(num_inference_steps={num_inference_steps})")
        scale_factor = one_minus_z[-1] / (1 - cfg.shift_terminal)
        s = 1 - (one_minus_z / scale_factor)
    if cfg.use_karras_sigmas:  # rho = 7, as in diffusers' EulerDiscreteScheduler
        lo, hi = s[-1].item() ** (1 / 7.0), s[0].item() ** (1 / 7.0)
        s = (hi + np.linspace(0, 1, num_inference_steps) * (lo - hi)) ** 7.0
    elif cfg.use_exponential_sigmas:
        s = np.exp(np.linspace(math.log(s[0].item()), math.log(s[-1].item()), num_inference_steps))

    s = torch.from_numpy(s).to(dtype=torch.float32, device=device)
    if cfg.invert_sigmas:  # Mochi: the model wants 1 - sigma
        s = 1.0 - s
        return torch.cat([s, torch.ones(1, device=s.device)]), s * n_train
    return torch.cat([s, torch.zeros(1, device=s.device)]), s * n_train


def _at(sigmas: Tensor, idx: Tensor) -> Tensor:
    """sigmas (N+1,) or (B, N+1), idx () or (B,) -> () or (B,)."""
    if sigmas.dim() == 1:
        return sigmas[idx]
    return sigmas.gather(1, idx.expand(sigmas.shape[0])[:, None])[:, 0]


def step(model_output: Tensor, sample: Tensor, sigmas: Tensor, step_idx: Tensor | int) -> Tensor:
    """One Euler step, x + (sigma_next - sigma) * v, for rows that may be at different steps.

    model_output, sample: (B, ...). sigmas: (N+1,) shared or (B, N+1) per row. step_idx: int or
    (B,) with sigma = sigmas[..., step_idx], sigma_next = sigmas[..., step_idx + 1].
    Returns model_output.dtype, which is what diffusers returns (pipelines then cast back to the
    latents' dtype). In diffusers dt is a 0-dim float32 tensor, so `dt * model_output` runs in
    model_output's dtype (dt rounded to it) before being added to the float32 sample; casting
    dt the same way keeps bf16/fp16 results bit-identical, not just close.
    """
    idx = torch.as_tensor(step_idx, device=sigmas.device)
    dt = (_at(sigmas, idx + 1) - _at(sigmas, idx)).to(sample.device)    # () or (B,), float32
    if dt.dim():
        dt = dt.reshape(-1, *[1] * (sample.dim() - 1))                  # (B, 1, ...)
    return (sample.float() + dt.to(model_output.dtype) * model_output).to(model_output.dtype)


@dataclass(frozen=True, slots=True)
class FlowMatchEuler:
    """This module's step as a `Solver` (solvers/__init__.py): one step needs no memory."""

    def new_state(self) -> None:
        return None

    def step(self, model_output: Tensor, sample: Tensor, sigmas: Tensor, step_idx: int,
             state: None) -> Tensor:
        return step(model_output, sample, sigmas, step_idx)


def scale_noise(sample: Tensor, sigma: Tensor | float, noise: Tensor) -> Tensor:
    """Forward process for img2img / inpainting: sigma * noise + (1 - sigma) * sample.

    sigma: a float32 value from `make_sigmas` (usually sigmas[t_start]), () or (B,) for rows with
    different strengths. Computed in sample.dtype, like diffusers' `scale_noise`.
    """
    sigma = torch.as_tensor(sigma, device=sample.device).to(sample.dtype)
    if sigma.dim():
        sigma = sigma.reshape(-1, *[1] * (sample.dim() - 1))
    return sigma * noise + (1.0 - sigma) * sample


def timesteps_for_strength(num_inference_steps: int, strength: float, order: int = 1) -> int:
    """img2img start index into the schedule for `strength` in [0, 1] (1 = start from pure noise).

    The request runs steps [t_start, N): N - t_start of them, starting from
    `scale_noise(image_latents, sigmas[t_start], noise)`. Same formula as `get_timesteps` in
    diffusers' FLUX / SD3 / Qwen-Image img2img pipelines (first-order solver: order = 1).
    """
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"strength: {strength} is not in [0, 1]")
    init_timestep = min(num_inference_steps * strength, num_inference_steps)
    t_start = int(max(num_inference_steps - init_timestep, 0))
    return t_start * order
