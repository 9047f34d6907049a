"""The built-in demo: handwritten digits from a class-conditional flow-matching DiT
(omnistage/models/digits_dit.py), 8x8 pixels shown upscaled. "a handwritten 7" or "seven"
chooses the digit; classifier-free guidance against the null class. Image-to-image: an input
image, greyed and reduced to 8x8 (light strokes on dark, as the training digits), is noised to
the strength's point of the schedule and redrawn as the digit asked for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from omnistage.layers.step_cache import cache_groups
from omnistage.diffusion.image_input import input_image, peek_image
from omnistage.diffusion.params import DiffusionParams, check_size
from omnistage.diffusion.pipeline import DiffusionPipeline
from omnistage.diffusion.request import DiffusionRequest
from omnistage.diffusion.solvers.flow_match_euler import scale_noise, timesteps_for_strength
from omnistage.errors import InputError
from omnistage.models.digits_dit import DigitsDiT, parse_digit

DEFAULT_SIZE = 64   # pixels: the 8x8 image upscaled 8x
DEFAULT_GUIDANCE = 2.0
MAX_SIZE = 512


class DigitsPipeline(DiffusionPipeline):
    label = "digits demo"

    def __init__(self, model: DigitsDiT, device: torch.device) -> None:
        self.model = model.to(device).eval()
        self.device = device
        self.image_size = model.config.image_size

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str, device: torch.device,
                        dtype: torch.dtype | None) -> DigitsPipeline:
        return cls(DigitsDiT.from_pretrained(path), device)

    def denoisers(self) -> list[torch.nn.Module]:
        return [self.model]

    def _size(self, params: DiffusionParams) -> tuple[int, int]:
        return params.height or DEFAULT_SIZE, params.width or DEFAULT_SIZE

    def validate(self, prompt: str, params: DiffusionParams,
                 image: Image.Image | None = None) -> None:
        parse_digit(prompt)
        if params.negative_prompt is not None or params.true_cfg_scale != 1.0:
            name = "negative_prompt" if params.negative_prompt is not None else "true_cfg_scale"
            raise InputError(f"{name}: the demo model guides against its null class only (no "
                             "negative prompt, true_cfg_scale 1)", name)
        check_size(*self._size(params), self.image_size, MAX_SIZE,
                   "the demo draws 8x8 digits, shown upscaled")
        if image is None and params.image is not None:
            peek_image(params.image)

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator,
                image: Image.Image | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        n, s = params.num_images, self.image_size
        image = input_image(params, image)
        latents = torch.randn(n, 1, s, s, generator=generator)             # (n, 1, 8, 8)
        sigmas = torch.linspace(1.0, 0.0, params.num_inference_steps + 1)   # as in training
        if image is not None:   # image-to-image: the 8x8 grey image is the latent
            start = timesteps_for_strength(params.num_inference_steps, params.image_strength)
            sigmas = sigmas[start:]
            grey = image.convert("L").resize((s, s), Image.Resampling.BOX)
            x0 = torch.from_numpy(np.asarray(grey, dtype=np.float32) / 127.5 - 1.0)
            latents = scale_noise(x0.expand(n, 1, s, s), sigmas[0], latents)
        return latents, sigmas, {"labels": torch.full((n,), parse_digit(prompt))}

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """Conditional and null-label halves in one forward; per-row guidance scales; step
        caching per request and branch when the request asks for it."""
        counts = [r.latents.shape[0] for r in requests]
        labels = torch.cat([r.cond["labels"] for r in requests]).to(self.device)  # (R,)
        scale = torch.cat([torch.full((n,), r.params.guidance(DEFAULT_GUIDANCE))
                           for r, n in zip(requests, counts)]).to(self.device)
        null = torch.full_like(labels, self.model.null_label)
        x, t, y = torch.cat([latents, latents]), sigmas.repeat(2), torch.cat([labels, null])
        if any(r.params.cache_threshold is not None for r in requests):
            every = [True] * len(requests)
            groups = cache_groups(requests, counts, [("cond", every), ("uncond", every)])
            v_cond, v_null = self.model.forward_cached(x, t, y, groups).chunk(2)
        else:
            v_cond, v_null = self.model(x, t, y).chunk(2)
        return v_null + scale.view(-1, 1, 1, 1) * (v_cond - v_null)

    def decode(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        """(n, 1, 8, 8) in [-1, 1] -> uint8 (n, H, W, 1), nearest-neighbour upscaled."""
        height, width = self._size(params)
        pixels = F.interpolate(latents.float().clamp(-1, 1), size=(height, width), mode="nearest")
        return ((pixels + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()
