"""What a diffusion pipeline provides to the engine: the three phases of a diffusers
`__call__`, split so the engine can batch the middle one across requests at different steps.

    1. prepare(prompt, params, generator) -> initial latents, schedule, conditioning
    2. velocity(latents, sigmas, requests) -> model output for a batch           (every step)
    3. decode(latents, params) -> images, uint8 (n, H, W, C)
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.request import DiffusionRequest


class DiffusionPipeline(Protocol):
    device: torch.device

    def validate(self, prompt: str, params: DiffusionParams) -> None: ...

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator
                ) -> tuple[Tensor, Tensor, dict[str, Tensor]]: ...

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """latents (R, ...) are the requests' rows in order, sigmas (R,) their current sigma;
        each request brings its conditioning, params and step-cache state."""

    def decode(self, latents: Tensor, params: DiffusionParams) -> Tensor: ...
