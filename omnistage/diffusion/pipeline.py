"""What a diffusion pipeline provides to the engine: the three phases of a diffusers
`__call__`, split so the engine can batch the middle one across requests at different steps.

    1. prepare(prompt, params, generator) -> initial latents, schedule, conditioning
    2. velocity(latents, timesteps, conds, params) -> model output for a batch   (every step)
    3. decode(latents, params) -> images, uint8 (n, H, W, C)
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from omnistage.diffusion.params import DiffusionParams


class DiffusionPipeline(Protocol):
    device: torch.device

    def validate(self, prompt: str, params: DiffusionParams) -> None: ...

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator
                ) -> tuple[Tensor, Tensor, dict[str, Tensor]]: ...

    def velocity(self, latents: Tensor, sigmas: Tensor, conds: list[dict[str, Tensor]],
                 params: list[DiffusionParams], rows: list[int]) -> Tensor: ...

    def decode(self, latents: Tensor, params: DiffusionParams) -> Tensor: ...
