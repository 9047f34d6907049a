"""DPM-Solver++ (2M, midpoint) over a VP noise schedule: the diffusion head's sampler, computed
as diffusers' DPMSolverMultistepScheduler does it (the defaults VibeVoice's generation config
names: `squaredcos_cap_v2` betas, `v_prediction`, linspace timesteps, final sigma zero, first
order at the last step), but without hidden state: the schedule is a value and a step takes
(step_idx, the previous data prediction), so a batch may hold frames at different steps.

    sigma(t) = sqrt((1 - abar_t) / abar_t)      alpha = 1 / sqrt(sigma^2 + 1), s = sigma * alpha
    x0 = alpha_s * x - s_s * v                  (v_prediction)
    first order:  x' = (s_t / s_s) x - alpha_t (e^-h - 1) x0
    second order: D1 = (x0 - x0_prev) / r0,  x' = first order - 0.5 alpha_t (e^-h - 1) D1
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

SUPPORTED = {"num_train_timesteps", "beta_schedule", "prediction_type", "beta_start",
             "beta_end", "solver_order", "algorithm_type", "solver_type", "lower_order_final",
             "final_sigmas_type", "timestep_spacing"}
DEFAULTS = {"num_train_timesteps": 1000, "beta_schedule": "linear", "prediction_type": "epsilon",
            "beta_start": 0.0001, "beta_end": 0.02, "solver_order": 2,
            "algorithm_type": "dpmsolver++", "solver_type": "midpoint",
            "lower_order_final": True, "final_sigmas_type": "zero",
            "timestep_spacing": "linspace"}

# diffusers' other settings, accepted at these (their default) values only
INERT = {"trained_betas": None, "thresholding": False, "dynamic_thresholding_ratio": 0.995,
         "sample_max_value": 1.0, "euler_at_final": False, "use_karras_sigmas": False,
         "use_exponential_sigmas": False, "use_beta_sigmas": False, "use_lu_lambdas": False,
         "use_flow_sigmas": False, "flow_shift": 1.0, "lambda_min_clipped": float("-inf"),
         "variance_type": None, "steps_offset": 0, "rescale_betas_zero_snr": False,
         "use_dynamic_shifting": False, "time_shift_type": "exponential"}


@dataclass(frozen=True, slots=True)
class NoiseSchedule:
    """The training schedule (what generation_config.json's `noise_scheduler_config` says)."""
    num_train_timesteps: int = 1000
    beta_schedule: str = "squaredcos_cap_v2"
    prediction_type: str = "v_prediction"
    beta_start: float = 0.0001
    beta_end: float = 0.02

    @classmethod
    def from_config(cls, doc: dict) -> NoiseSchedule:
        """diffusers' DPMSolverMultistepScheduler keyword arguments; any other setting than
        the defaults this solver computes raises (NotImplementedError naming the key)."""
        merged = {**DEFAULTS, **doc}
        for key, value in merged.items():
            if key not in SUPPORTED and not key.startswith("_") and \
                    INERT.get(key, object()) != value:
                raise NotImplementedError(f"noise_scheduler_config.{key}={value!r} is not supported")
        fixed = {"solver_order": 2, "algorithm_type": "dpmsolver++", "solver_type": "midpoint",
                 "lower_order_final": True, "final_sigmas_type": "zero",
                 "timestep_spacing": "linspace"}
        for key, want in fixed.items():
            if merged[key] != want:
                raise NotImplementedError(f"noise_scheduler_config.{key}={merged[key]!r}: only "
                                          f"{want!r} is supported")
        if merged["beta_schedule"] not in ("squaredcos_cap_v2", "linear", "scaled_linear"):
            raise NotImplementedError(f"beta_schedule {merged['beta_schedule']!r}")
        if merged["prediction_type"] not in ("v_prediction", "epsilon"):
            raise NotImplementedError(f"prediction_type {merged['prediction_type']!r}")
        return cls(int(merged["num_train_timesteps"]), merged["beta_schedule"],
                   merged["prediction_type"], float(merged["beta_start"]),
                   float(merged["beta_end"]))

    def alphas_cumprod(self) -> Tensor:
        n = self.num_train_timesteps
        if self.beta_schedule == "squaredcos_cap_v2":
            def abar(t: float) -> float:
                return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
            betas = torch.tensor([min(1 - abar((i + 1) / n) / abar(i / n), 0.999)
                                  for i in range(n)], dtype=torch.float32)
        elif self.beta_schedule == "linear":
            betas = torch.linspace(self.beta_start, self.beta_end, n, dtype=torch.float32)
        else:
            betas = torch.linspace(self.beta_start ** 0.5, self.beta_end ** 0.5, n,
                                   dtype=torch.float32) ** 2
        return torch.cumprod(1.0 - betas, dim=0)


@dataclass(frozen=True, slots=True)
class SolverSteps:
    """One sampling schedule: timesteps (N,) int64 and sigmas (N + 1,) float32, on the CPU."""
    timesteps: Tensor
    sigmas: Tensor
    prediction_type: str

    @classmethod
    def make(cls, schedule: NoiseSchedule, num_steps: int) -> SolverSteps:
        if num_steps < 1:
            raise ValueError(f"num_diffusion_steps={num_steps}: must be >= 1")
        abar = schedule.alphas_cumprod()
        n = schedule.num_train_timesteps
        timesteps = np.linspace(0, n - 1, num_steps + 1).round()[::-1][:-1].copy().astype(np.int64)
        all_sigmas = (((1 - abar) / abar) ** 0.5).numpy()
        sigmas = np.interp(timesteps, np.arange(0, len(all_sigmas)), all_sigmas)
        sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
        return cls(torch.from_numpy(timesteps), torch.from_numpy(sigmas), schedule.prediction_type)

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)


def _alpha_sigma(sigma: Tensor) -> tuple[Tensor, Tensor]:
    alpha = 1 / ((sigma ** 2 + 1) ** 0.5)
    return alpha, sigma * alpha


def dpm_step(steps: SolverSteps, step_idx: int, sample: Tensor, model_output: Tensor,
             prev_x0: Tensor | None) -> tuple[Tensor, Tensor]:
    """One step from `steps.sigmas[step_idx]` to `[step_idx + 1]`: -> (next sample, this
    step's data prediction x0, which the next step takes as `prev_x0`). First order at the
    first step (no `prev_x0`) and at the last (final sigma zero)."""
    sigmas = steps.sigmas
    alpha_s0, sigma_s0 = _alpha_sigma(sigmas[step_idx])
    if steps.prediction_type == "v_prediction":
        x0 = alpha_s0 * sample - sigma_s0 * model_output
    else:
        x0 = (sample - sigma_s0 * model_output) / alpha_s0
    sample = sample.to(torch.float32)
    alpha_t, sigma_t = _alpha_sigma(sigmas[step_idx + 1])
    h = (torch.log(alpha_t) - torch.log(sigma_t)) - (torch.log(alpha_s0) - torch.log(sigma_s0))
    last = step_idx == steps.num_steps - 1
    if prev_x0 is None or last:
        out = (sigma_t / sigma_s0) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * x0
    else:
        alpha_s1, sigma_s1 = _alpha_sigma(sigmas[step_idx - 1])
        h_0 = (torch.log(alpha_s0) - torch.log(sigma_s0)) - (torch.log(alpha_s1)
                                                              - torch.log(sigma_s1))
        r0 = h_0 / h
        d1 = (1.0 / r0) * (x0 - prev_x0)
        out = ((sigma_t / sigma_s0) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * x0
               - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * d1)
    return out.to(model_output.dtype), x0
