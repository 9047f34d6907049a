"""The built-in demo: handwritten digits from a class-conditional flow-matching DiT
(omnistage/models/digits_dit.py), 8x8 pixels shown upscaled. "a handwritten 7" or "seven"
chooses the digit; classifier-free guidance against the null class."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from omnistage.diffusion.params import DiffusionParams
from omnistage.models.digits_dit import DigitsDiT, parse_digit

DEFAULT_SIZE = 64   # pixels: the 8x8 image upscaled 8x
MAX_SIZE = 512


class DigitsPipeline:
    def __init__(self, model: DigitsDiT, device: torch.device) -> None:
        self.model = model.to(device).eval()
        self.device = device
        self.image_size = model.config.image_size

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str, device: torch.device,
                        dtype: torch.dtype | None) -> DigitsPipeline:
        return cls(DigitsDiT.from_pretrained(path), device)

    def _size(self, params: DiffusionParams) -> tuple[int, int]:
        return params.height or DEFAULT_SIZE, params.width or DEFAULT_SIZE

    def validate(self, prompt: str, params: DiffusionParams) -> None:
        parse_digit(prompt)
        if params.negative_prompt is not None or params.true_cfg_scale != 1.0:
            raise ValueError("negative_prompt / true_cfg_scale: the demo model guides against "
                             "its null class only")
        if params.cache_threshold is not None:
            raise ValueError("cache_threshold: step caching is not available for the demo "
                             "model")
        for name, value in zip(("height", "width"), self._size(params)):
            if value % self.image_size:
                raise ValueError(f"{name}={value}: must be a multiple of {self.image_size} "
                                 "(the demo draws 8x8 digits, shown upscaled)")
            if value > MAX_SIZE:
                raise ValueError(f"{name}={value}: the maximum is {MAX_SIZE}")

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator
                ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        n, s = params.num_images, self.image_size
        latents = torch.randn(n, 1, s, s, generator=generator)             # (n, 1, 8, 8)
        sigmas = torch.linspace(1.0, 0.0, params.num_inference_steps + 1)   # as in training
        return latents, sigmas, {"labels": torch.full((n,), parse_digit(prompt))}

    def velocity(self, latents: Tensor, sigmas: Tensor, conds: list[dict[str, Tensor]],
                 params: list[DiffusionParams], counts: list[int]) -> Tensor:
        """Conditional and null-label halves in one forward; per-row guidance scales."""
        labels = torch.cat([c["labels"] for c in conds]).to(self.device)   # (R,)
        scale = torch.cat([torch.full((n,), p.guidance_scale) for p, n in zip(params, counts)])
        null = torch.full_like(labels, self.model.null_label)
        v_cond, v_null = self.model(torch.cat([latents, latents]), sigmas.repeat(2),
                                    torch.cat([labels, null])).chunk(2)
        scale = scale.to(self.device).view(-1, 1, 1, 1)
        return v_null + scale * (v_cond - v_null)

    def decode(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        """(n, 1, 8, 8) in [-1, 1] -> uint8 (n, H, W, 1), nearest-neighbour upscaled."""
        height, width = self._size(params)
        pixels = F.interpolate(latents.float().clamp(-1, 1), size=(height, width), mode="nearest")
        return ((pixels + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()
