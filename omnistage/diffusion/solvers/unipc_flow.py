"""Flow-prediction UniPC multistep: diffusers' `UniPCMultistepScheduler` with
`prediction_type="flow_prediction"`, `use_flow_sigmas=True`, as Wan2.1 / Wan2.2 ship it.

Convention (rectified flow, as in flow_match_euler.py):

    x_s = s * noise + (1 - s) * x0        alpha_s = 1 - s, sigma_s = s
    v   = noise - x0                      the model output;  x0 = x_s - s * v   (m_i at step i)
    lambda_s = log(alpha_s) - log(sigma_s)                    half the log-SNR, rising as s falls

Schedule: N values `s = linspace(1, 1/1000, N+1)[:-1]`, shifted `shift*s / (1 + (shift-1)*s)`,
the first nudged to 1 - 1e-6 (so lambda_0 is finite); the model sees `timesteps = int(s * 1000)`,
truncated. The final sigma is 0 (`final_sigmas_type="zero"`) or a copy of the last one
("sigma_min", which makes the final step a no-op that leaves that noise in).

Step i moves x from s = sigmas[i] to t = sigmas[i+1], with h = lambda_t - lambda_s > 0, in the
data-prediction form (predict_x0) of UniPC (Zhao et al. 2023, arXiv:2302.04867):

    UniP-p, the predictor of order p, from x_s and the x0 predictions m_i, m_{i-1}, ...:
        x_t = sigma_t/sigma_s * x_s - alpha_t * expm1(-h) * m_i - alpha_t * B(h) * sum_k rho_k D_k
        D_k = (m_{i-k} - m_i) / r_k,   r_k = (lambda(sigmas[i-k]) - lambda_s) / h,  k < p
        B(h) = expm1(-h) ("bh2", Wan) or -h ("bh1")
        rho solves sum_k r_k^j rho_k = g_j (j < p-1), g_j = (j+1)! * (-h) phi_{j+2}(-h) / B(h),
        phi the exponential-integrator functions; rho = 1/2 when p = 2
    UniC-p, the corrector, at the start of step i+1, once m_{i+1} = x0(x_t) is known: the same
        update of x_s redone with one more difference, D_p = m_{i+1} - m_i (r_p = 1), and p
        unknowns (rho = 1/2 when p = 1), which raises its order of accuracy to p + 1 at no extra
        model call. The corrected x_t replaces the predicted one; m_{i+1} is not recomputed.

Order: 1 on the first step (one m known), then `solver_order` (2 for Wan); with
`lower_order_final` it falls to N - i near the end, so the last step is first order. With the
final sigma 0 that last step returns m_{N-1} exactly (sigma_t = 0, expm1(-inf) = -1).

Why a state object: diffusers keeps the history (`model_outputs`, `last_sample`,
`lower_order_nums`, `this_order`) and `_step_index` on the scheduler, so one instance serves one
request. Here each request owns a small `UniPCState` and its own `(sigmas, step_idx)`, as with the
Euler solver, so one batch holds requests at different steps and with different schedules.

Bit-identity: the scalar coefficients are 0-dim float32 tensors computed with the same operations
in the same order as diffusers, the x0 prediction uses `sigmas[i]` where the schedule lives (CPU,
as in diffusers), the coefficients on the sample's device; so float32 and bfloat16 results match
diffusers bit for bit, not just closely. That is why a batch is stepped request by request
(`step_batch`): (B, 1, ...) coefficient tensors would change how PyTorch rounds a float32 scalar
against bfloat16 latents. The per-request work is ~10 elementwise passes over the latents plus a
2x2 `linalg.solve`, small next to a video transformer's forward.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor

# scheduler_config.json keys whose non-default values take diffusers down paths we do not copy
_UNSUPPORTED = ("thresholding", "solver_p", "use_karras_sigmas", "use_exponential_sigmas",
                "use_beta_sigmas", "use_dynamic_shifting", "shift_terminal")


@dataclass(frozen=True, slots=True)
class UniPCConfig:
    """The fields of a `UniPCMultistepScheduler` scheduler_config.json that the flow path reads.

    Defaults are diffusers' (so a config that omits a key means what it means there); Wan's
    published configs set flow_shift 3.0 (Wan2.1 480p, Wan2.2 A14B) or 5.0 (720p, TI2V-5B) and
    keep the rest at these defaults. flow_shift and final_sigmas_type shape only the schedule
    (`make_sigmas`); `step` reads the rest, so requests with different shifts share a step."""

    num_train_timesteps: int = 1000
    solver_order: int = 2
    solver_type: Literal["bh1", "bh2"] = "bh2"
    lower_order_final: bool = True
    disable_corrector: tuple[int, ...] = ()   # step indices whose result is not corrected
    flow_shift: float = 1.0
    final_sigmas_type: Literal["zero", "sigma_min"] = "zero"

    def __post_init__(self) -> None:
        if self.solver_order < 1:
            raise ValueError(f"solver_order: {self.solver_order} < 1")
        if self.solver_type not in ("bh1", "bh2"):
            raise ValueError(f"solver_type: {self.solver_type!r} is not 'bh1' or 'bh2'")
        if self.final_sigmas_type not in ("zero", "sigma_min"):
            raise ValueError(f"final_sigmas_type: {self.final_sigmas_type!r} is not 'zero' or "
                             "'sigma_min'")

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> UniPCConfig:
        """Keeps our fields, drops the rest (betas, timestep_spacing: unused with flow sigmas),
        and refuses what would make diffusers compute something else."""
        if d.get("prediction_type", "epsilon") != "flow_prediction":
            raise NotImplementedError(f"prediction_type: {d.get('prediction_type')!r}; only "
                                      "'flow_prediction' is supported")
        if not d.get("use_flow_sigmas", False):
            raise NotImplementedError("use_flow_sigmas: only flow sigmas are supported")
        if not d.get("predict_x0", True):
            raise NotImplementedError("predict_x0: flow_prediction needs predict_x0=True")
        for key in _UNSUPPORTED:
            if d.get(key):
                raise NotImplementedError(f"{key}: {d[key]!r} is not supported")
        names = {f.name for f in fields(cls)}
        kept = {k: v for k, v in d.items() if k in names}
        kept["disable_corrector"] = tuple(kept.get("disable_corrector") or ())
        return cls(**kept)

    @classmethod
    def from_json(cls, path: str | Path) -> UniPCConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass(slots=True)
class UniPCState:
    """One request's memory between its steps; new (empty) for each request.

    A fresh state starts at whatever step it is first used on with a first-order step and no
    correction, as diffusers does after `set_begin_index` (img2img)."""

    x0_preds: list[Tensor] = field(default_factory=list)  # the last solver_order m's, newest last
    last_sample: Tensor | None = None   # x at the start of the previous step, after correction
    last_order: int = 0                 # that step's predictor order, reused by the corrector
    last_step_idx: int = -1             # the next step must be the one after it


def make_sigmas(cfg: UniPCConfig, num_inference_steps: int) -> tuple[Tensor, Tensor]:
    """-> (sigmas (N+1,) float32 on CPU, timesteps (N,) int64), what `set_timesteps` produces.

    Keep the sigmas on the CPU, as diffusers does: `step` reads them there."""
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps: {num_inference_steps} < 1")
    n_train = cfg.num_train_timesteps
    s = np.linspace(1, 1 / n_train, num_inference_steps + 1)[:-1]          # float64
    s = cfg.flow_shift * s / (1 + (cfg.flow_shift - 1) * s)
    if np.fabs(s[0] - 1) < 1e-6:   # diffusers: keeps log(alpha) of the first sigma finite
        s[0] -= 1e-6
    timesteps = torch.from_numpy(s * n_train).to(torch.int64)
    last = s[-1] if cfg.final_sigmas_type == "sigma_min" else 0
    return torch.from_numpy(np.concatenate([s, [last]]).astype(np.float32)), timesteps


def _lambda(sigma: Tensor) -> Tensor:
    """log(alpha) - log(sigma) for a flow sigma (alpha = 1 - sigma), 0-dim float32."""
    return torch.log(1 - sigma) - torch.log(sigma)


def _update(cfg: UniPCConfig, x: Tensor, ms: list[Tensor], sigmas: Tensor, s0: int, order: int,
            model_t: Tensor | None = None) -> Tensor:
    """UniP-order (model_t None) or UniC-order (model_t = x0 prediction at sigmas[s0 + 1]) from
    x at sigmas[s0] to sigmas[s0 + 1]; ms[-1 - k] is the x0 prediction at sigmas[s0 - k].

    diffusers' `multistep_uni_p_bh_update` / `multistep_uni_c_bh_update`, op for op."""
    dev = x.device
    sigma_t, sigma_s0 = sigmas[s0 + 1].to(dev), sigmas[s0].to(dev)
    alpha_t = 1 - sigma_t
    lambda_s0 = _lambda(sigma_s0)
    h = _lambda(sigma_t) - lambda_s0
    m0 = ms[-1]
    rks, d1s = [], []
    for k in range(1, order):
        rk = (_lambda(sigmas[s0 - k].to(dev)) - lambda_s0) / h
        rks.append(rk)
        d1s.append((ms[-(k + 1)] - m0) / rk)
    rks = torch.stack([*rks, torch.ones((), device=dev)])

    hh = -h                          # predict_x0
    h_phi_1 = torch.expm1(hh)        # h * phi_1(h) = e^h - 1
    h_phi_k = h_phi_1 / hh - 1
    b_h = hh if cfg.solver_type == "bh1" else torch.expm1(hh)
    factorial_i, r, g = 1, [], []
    for i in range(1, order + 1):
        r.append(torch.pow(rks, i - 1))
        g.append(h_phi_k * factorial_i / b_h)
        factorial_i *= i + 1
        h_phi_k = h_phi_k / hh - 1 / factorial_i
    r, g = torch.stack(r), torch.stack(g)

    x_t_ = sigma_t / sigma_s0 * x - alpha_t * h_phi_1 * m0
    d1 = torch.stack(d1s, dim=1) if d1s else None     # (B, order - 1, ...)
    if model_t is None:
        res = 0
        if d1 is not None:
            rhos_p = (torch.ones(1, dtype=x.dtype, device=dev) * 0.5 if order == 2 else
                      torch.linalg.solve(r[:-1, :-1], g[:-1]).to(dev).to(x.dtype))
            res = torch.einsum("k,bkc...->bc...", rhos_p, d1)
        return (x_t_ - alpha_t * b_h * res).to(x.dtype)
    rhos_c = (torch.ones(1, dtype=x.dtype, device=dev) * 0.5 if order == 1 else
              torch.linalg.solve(r, g).to(dev).to(x.dtype))
    res = 0 if d1 is None else torch.einsum("k,bkc...->bc...", rhos_c[:-1], d1)
    return (x_t_ - alpha_t * b_h * (res + rhos_c[-1] * (model_t - m0))).to(x.dtype)


def step(cfg: UniPCConfig, model_output: Tensor, sample: Tensor, sigmas: Tensor, step_idx: int,
         state: UniPCState) -> Tensor:
    """One request's step i (all its rows at the same step): correct x_i with m_i, then predict
    x_{i+1}. Updates `state`; returns the new sample in sample.dtype, like diffusers' `step`.

    model_output, sample: (B, C, ...) (at least 3-D, as in diffusers' einsum). sigmas: this
    request's schedule from `make_sigmas`, on the CPU."""
    assert sigmas.device.type == "cpu", f"sigmas on {sigmas.device}: diffusers keeps them on CPU"
    assert state.last_step_idx in (-1, step_idx - 1), (state.last_step_idx, step_idx)
    i, num_steps = step_idx, sigmas.shape[0] - 1
    x0 = sample - sigmas[i] * model_output            # convert_model_output, flow_prediction
    if state.last_sample is not None and i - 1 not in cfg.disable_corrector:
        sample = _update(cfg, state.last_sample, state.x0_preds, sigmas, i - 1,
                         state.last_order, model_t=x0)
    state.x0_preds = [*state.x0_preds, x0][-cfg.solver_order:]
    order = len(state.x0_preds)   # warm-up: only as many as are known, up to solver_order
    if cfg.lower_order_final:
        order = min(order, num_steps - i)
    state.last_sample, state.last_order, state.last_step_idx = sample, order, i
    return _update(cfg, sample, state.x0_preds, sigmas, i, order)


def step_batch(cfg: UniPCConfig, model_output: Tensor, sample: Tensor, counts: Sequence[int],
               sigmas: Sequence[Tensor], step_idx: Sequence[int], states: Sequence[UniPCState]
               ) -> Tensor:
    """Requests at different steps and with different schedules in one batch: request j owns
    the next counts[j] rows, its sigmas[j], step_idx[j] and states[j]. -> (sum(counts), ...)."""
    rows = zip(model_output.split(list(counts)), sample.split(list(counts)), sigmas, step_idx,
               states, strict=True)
    return torch.cat([step(cfg, out, x, s, i, st) for out, x, s, i, st in rows])


@dataclass(frozen=True, slots=True)
class FlowUniPC:
    """The `Solver` the engine holds: this config's schedule, state and step."""

    cfg: UniPCConfig

    def make_sigmas(self, num_inference_steps: int, flow_shift: float | None = None
                    ) -> tuple[Tensor, Tensor]:
        """The schedule; `flow_shift`: a request's own shift instead of the config's."""
        cfg = self.cfg if flow_shift is None else replace(self.cfg, flow_shift=flow_shift)
        return make_sigmas(cfg, num_inference_steps)

    def new_state(self) -> UniPCState:
        return UniPCState()

    def step(self, model_output: Tensor, sample: Tensor, sigmas: Tensor, step_idx: int,
             state: UniPCState) -> Tensor:
        return step(self.cfg, model_output, sample, sigmas, step_idx, state)
