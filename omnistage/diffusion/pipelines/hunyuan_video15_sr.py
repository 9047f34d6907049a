"""HunyuanVideo-1.5 super resolution: the upstream repository's second pass
(`HunyuanVideo_1_5_SR_Pipeline`, hyvideo/pipelines/hunyuan_video_sr_pipeline.py), which
diffusers does not ship, on our layers. A finished base video's latents (480p or 720p) become
720p or 1080p latents, then the same VAE decodes them.

    size:       the high-resolution bucket (sides multiples of 16, about hr_base^2 pixels) whose
                aspect is nearest the low-resolution video's (upstream `BucketMap`; a base size
                outside the low-resolution buckets maps the same way instead of failing)
    LQ latents: the base latents resized bilinearly per frame to the high-resolution grid ->
                the released latent upsampler (float32, models/hunyuan_video15_upsampler.py)
                -> noised to strength 0.7: (1 - 0.7) x + 0.7 n, n ~ N(0, 1)
    schedule:   flow-match Euler from fresh noise (the request's generator) on sigmas
                linspace(1, 0, N+1) shifted by `shift` (upstream FlowMatchDiscreteScheduler),
                timesteps 1000 sigma; the distilled SR checkpoints: N 6 (720p) / 8 (1080p),
                shift 2, guidance 1 (upstream `SR_PIPELINE_CONFIGS`)
    transformer input, 98 channels (the SR DiT: the base architecture, in_channels 98):
                [noisy z | image condition z + mask (zeros for text-to-video) | LQ z + mask 1]
                and once the timestep is below 1000 x 0.7 the LQ part and its mask are zeroed
    text:       the base request's own prompt states (Qwen2.5-VL + byT5); no guidance
    image:      image-to-video encodes its first frame again, cropped the upstream way
                (`cover_crop`): at the high-resolution size, VAE latents on frame 0 + mask as
                the condition; at the bucket of the image's own aspect (`image_bucket`),
                SigLIP tokens: the i2v pipeline's `sr_inputs`

In the stage: `diffusion.options` `sr: true` + `sr_checkpoint` (`HunyuanVideo15Options`); the
pass runs in the request's decode (`final_latents`), after its base loop, on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from omnistage.models.hunyuan_video15_original import RESOLUTIONS, load_original_transformer
from omnistage.models.hunyuan_video15_transformer import HunyuanVideo15Transformer3DModel
from omnistage.models.hunyuan_video15_upsampler import (SRTo720pUpsampler, SRTo1080pUpsampler,
                                                        load_upsampler)

LQ_STRENGTH = 0.7           # upstream `noise_scale`: the LQ latents' noise, and the timestep
                            # (x 1000) below which the transformer no longer sees them


@dataclass(frozen=True, slots=True)
class SRRecipe:
    """One released SR checkpoint pair (`transformer/<version>`, `upsampler/<version>`) and
    its upstream defaults (`SR_PIPELINE_CONFIGS`)."""
    version: str
    hr_base: int                # the high-resolution buckets' side, px
    num_inference_steps: int
    flow_shift: float = 2.0


# the base checkpoint's bucket side (its transformer's target_size) -> the SR it takes, as
# upstream's TRANSFORMER_VERSION_TO_SR_VERSION pairs them (480p -> 720p, 720p -> 1080p)
RECIPES = {RESOLUTIONS["480p"]: SRRecipe("720p_sr_distilled", RESOLUTIONS["720p"], 6),
           RESOLUTIONS["720p"]: SRRecipe("1080p_sr_distilled", RESOLUTIONS["1080p"], 8)}


@dataclass(frozen=True, slots=True)
class HunyuanVideo15Options:
    """A HunyuanVideo-1.5 stage's `diffusion.options`. sr: run the super-resolution pass
    after the base loop (upstream generate.py's `--sr`; 480p checkpoints go to 720p, 720p ones
    to 1080p), from `sr_checkpoint`, a folder in the released layout of tencent/HunyuanVideo-1.5
    (its transformer/<version>/ and upsampler/<version>/); sr_num_inference_steps: the pass's
    steps (None: the checkpoint's 6 or 8)."""
    sr: bool = False
    sr_checkpoint: str | None = None
    sr_num_inference_steps: int | None = None

    def __post_init__(self) -> None:
        if self.sr and not self.sr_checkpoint:
            raise ValueError("sr_checkpoint: required with sr: true (a folder holding "
                             "transformer/<version>/ and upsampler/<version>/ of "
                             "tencent/HunyuanVideo-1.5)")
        if self.sr_num_inference_steps is not None and not 1 <= self.sr_num_inference_steps <= 100:
            raise ValueError(f"sr_num_inference_steps={self.sr_num_inference_steps}: must be "
                             "in [1, 100]")


def crop_sizes(base: int, multiple: int = 16, max_ratio: float = 4.0) -> list[tuple[int, int]]:
    """The resolution buckets (width, height) of about base^2 pixels, sides multiples of
    `multiple`, aspect at most max_ratio, in the upstream's order (`generate_crop_size_list`)."""
    cells = round((base / multiple) ** 2)
    out, w, h = [], cells, 1
    while w > 0:
        if max(w, h) / min(w, h) <= max_ratio:
            out.append((w * multiple, h * multiple))
        if (h + 1) * w <= cells:
            h += 1
        else:
            w -= 1
    return out


def hr_size(height: int, width: int, hr_base: int, multiple: int = 16) -> tuple[int, int]:
    """(height, width) of the high-resolution bucket nearest the aspect width / height (the
    first such bucket on ties, as numpy's argmin)."""
    buckets = crop_sizes(hr_base, multiple)
    ratios = np.array([float(w) / float(h) for w, h in buckets])
    w, h = buckets[int(np.abs(ratios - float(width) / float(height)).argmin())]
    return h, w


def image_bucket(height: int, width: int, base: int, multiple: int = 16) -> tuple[int, int]:
    """(height, width): the bucket of about base^2 pixels whose aspect (rounded to 5 digits)
    is nearest height / width, the first on ties (upstream
    `get_closest_resolution_given_original_size`, which crops the SR pass's SigLIP input)."""
    buckets = crop_sizes(base, multiple)
    ratios = np.array([round(float(a) / float(b), 5) for a, b in buckets])
    return buckets[int(np.abs(ratios - float(height) / float(width)).argmin())]


def sr_sigmas(num_steps: int, shift: float) -> tuple[Tensor, Tensor]:
    """(sigmas (N+1,), timesteps (N,)) float32, as the upstream FlowMatchDiscreteScheduler."""
    s = torch.linspace(1, 0, num_steps + 1)
    if shift != 1.0:
        s = shift * s / (1 + (shift - 1) * s)
    return s, (s[:-1] * 1000).to(torch.float32)


def noise_lq(lq: Tensor, noise: Tensor, strength: float = LQ_STRENGTH) -> Tensor:
    """The upstream `add_noise_to_lq`, its float32 arithmetic kept."""
    s = torch.tensor([1000.0], device=lq.device) * strength / 1000.0
    return (1 - s) * lq + s * noise


class SuperResolution:
    """The SR DiT and its latent upsampler, one recipe."""

    def __init__(self, transformer: HunyuanVideo15Transformer3DModel,
                 upsampler: SRTo720pUpsampler | SRTo1080pUpsampler, recipe: SRRecipe,
                 device: torch.device) -> None:
        cfg = transformer.cfg
        if cfg.in_channels != 3 * cfg.out_channels + 2:
            raise ValueError(f"not a super-resolution transformer: in_channels "
                             f"{cfg.in_channels}, an SR DiT takes 3 z + 2 = "
                             f"{3 * cfg.out_channels + 2} ([noisy z | cond z, mask | LQ z, mask])")
        self.transformer = transformer.to(device).eval()
        self.upsampler = upsampler.to(device).eval()
        self.recipe, self.device = recipe, device
        self.dtype = transformer.x_embedder.proj.weight.dtype

    @classmethod
    def from_pretrained(cls, path: str | Path, base_size: int, device: torch.device,
                        dtype: torch.dtype | None) -> SuperResolution:
        """From a folder in the released layout (tencent/HunyuanVideo-1.5, or one holding its
        transformer/<version>/ and upsampler/<version>/), the recipe of a base checkpoint whose
        buckets have side `base_size` (its transformer's target_size: 640 or 960)."""
        if base_size not in RECIPES:
            raise ValueError(f"sr: no super-resolution checkpoint follows a base of "
                             f"{base_size} px buckets (480p: 640, 720p: 960)")
        recipe, path = RECIPES[base_size], Path(path)
        for part in ("transformer", "upsampler"):
            if not (path / part / recipe.version / "config.json").is_file():
                raise FileNotFoundError(f"{path}: no {part}/{recipe.version}/ (the released "
                                        "super-resolution checkpoints of tencent/HunyuanVideo-1.5)")
        transformer = load_original_transformer(path / "transformer" / recipe.version, device,
                                                dtype)
        upsampler = load_upsampler(path / "upsampler" / recipe.version, device)
        return cls(transformer, upsampler, recipe, device)

    @torch.no_grad()
    def upsample(self, lq: Tensor, size: tuple[int, int]) -> Tensor:
        """Base latents (B, z, F, h, w) -> upsampled (B, z, F, H, W) float32 at latent size."""
        b = lq.shape[0]
        x = lq.to(self.device, torch.float32).transpose(1, 2).flatten(0, 1)   # (B F, z, h, w)
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
        x = x.unflatten(0, (b, -1)).transpose(1, 2)                            # (B, z, F, H, W)
        return self.upsampler(x.contiguous())

    def condition(self, lq_noised: Tensor, image_cond: Tensor | None) -> tuple[Tensor, Tensor]:
        """The 66 condition channels with and without the LQ part: (B, 2 z + 2, F, H, W) x 2."""
        b, z, f, h, w = lq_noised.shape
        if image_cond is None:                   # text-to-video: [zeros | mask 0]
            image_cond = lq_noised.new_zeros(b, z + 1, f, h, w)
        ones = lq_noised.new_ones(b, 1, f, h, w)
        with_lq = torch.cat([image_cond.to(lq_noised), lq_noised, ones], dim=1)
        without = torch.cat([image_cond.to(lq_noised), torch.zeros_like(lq_noised),
                             torch.zeros_like(ones)], dim=1)
        return with_lq, without

    @torch.no_grad()
    def run(self, latents: Tensor, lq_up: Tensor, lq_noise: Tensor, text: dict[str, Tensor],
            num_steps: int, shift: float, image_cond: Tensor | None = None) -> Tensor:
        """The denoising pass. latents: the initial noise (B, z, F, H, W); lq_up: `upsample`'s
        output; lq_noise: its noise; text: the transformer's text inputs (encoder_hidden_states
        (B, L, D) and its mask, encoder_hidden_states_2 and its mask). -> (B, z, F, H, W)."""
        x = latents.to(self.device, torch.float32)              # stepped in float32
        lq = noise_lq(lq_up.to(self.dtype), lq_noise.to(self.device, self.dtype))
        with_lq, without = self.condition(lq, image_cond)
        sigmas, timesteps = sr_sigmas(num_steps, shift)
        for i, t in enumerate(timesteps):
            cond = with_lq if t >= 1000 * LQ_STRENGTH else without
            v = self.transformer(torch.cat([x.to(self.dtype), cond], dim=1),
                                 t.repeat(x.shape[0]).to(self.device, self.dtype), **text)
            x = x + v.float() * (sigmas[i + 1] - sigmas[i]).to(self.device)
        return x

    def target_shape(self, lq_shape: tuple[int, ...], downscale: int, multiple: int
                     ) -> tuple[int, int, int, int, int]:
        """(n, z, F, H, W): the high-resolution latents of base latents (n, z, F, h, w) whose
        latents are `downscale` px each: the bucket of the base video's aspect, sides
        multiples of `multiple` (the VAE's factor x the patch)."""
        n, z, f, h, w = lq_shape
        height, width = hr_size(h * downscale, w * downscale, self.recipe.hr_base, multiple)
        return n, z, f, height // downscale, width // downscale

    def refine(self, lq: Tensor, text: dict[str, Tensor], generator: torch.Generator,
               shape: tuple[int, ...], num_steps: int | None = None,
               image_cond: Tensor | None = None) -> Tensor:
        """A finished base video's latents (n, z, F, h, w) -> its high-resolution latents of
        `shape` (`target_shape`): fresh noise, then the LQ noise, from `generator`; the
        recipe's schedule (num_steps: its own count)."""
        latents = torch.randn(shape, generator=generator, dtype=torch.float32)
        lq_noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        up = self.upsample(lq, tuple(shape[3:]))
        return self.run(latents, up, lq_noise, text, num_steps or self.recipe.num_inference_steps,
                        self.recipe.flow_shift, image_cond)
