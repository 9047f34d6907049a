"""Per-request state of the diffusion engine. The step index, and a multistep solver's memory
(`solver_state`), live here, not in a solver, so one batch can hold requests at different
steps (see solvers/__init__.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.solvers import Solver
from omnistage.diffusion.solvers.flow_match_euler import FlowMatchEuler
from omnistage.layers.step_cache import StepCacheState


@dataclass(slots=True)
class DiffusionRequest:
    request_id: str
    prompt: str | None              # None: encoded by an upstream text-encoder stage
    params: DiffusionParams
    latents: Tensor                 # (num_images, *latent_shape)
    sigmas: Tensor                  # (num_steps + 1,) decreasing to 0
    cond: dict[str, Tensor]         # what the pipeline's denoiser needs (embeddings, labels)
    generator: torch.Generator
    step_idx: int = 0
    arrival_time: float = field(default_factory=time.time)
    conditioning_time: float | None = None   # when an upstream stage's conditioning arrived
    first_step_time: float | None = None
    cache: dict[str, StepCacheState] = field(default_factory=dict)  # per branch (cond, uncond)
    solver: Solver = field(default_factory=FlowMatchEuler)      # the pipeline's, if it has one
    solver_state: object = None     # solver.new_state(): what it remembers between steps

    @property
    def num_steps(self) -> int:
        return self.sigmas.shape[0] - 1

    @property
    def is_done(self) -> bool:
        return self.step_idx >= self.num_steps

    @property
    def batch_key(self) -> tuple:
        """Requests with equal keys can share one transformer forward."""
        return (tuple(self.latents.shape[1:]), self.latents.dtype)

    @property
    def num_steps_skipped(self) -> int:
        """Steps whose conditional branch reused the cached residual: its states' sum (one
        "cond" state; Wan2.2 A14B's "cond0", "cond1", one per expert)."""
        return sum(s.num_skipped for name, s in self.cache.items() if name.startswith("cond"))

    @property
    def must_compute(self) -> bool:
        """Step caching never skips the first or the last step."""
        return self.step_idx == 0 or self.step_idx == self.num_steps - 1

    @property
    def progress(self) -> float:
        return self.step_idx / self.num_steps
