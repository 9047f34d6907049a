"""LTX-2's latent upsampler: the x2 (or rational x1.5) spatial resampler between the two
denoising stages of LTX-2's two-stage recipe, read from a diffusers `latent_upsampler/` folder
(`LTX2LatentUpsamplerModel`), its tensor names kept.

    (B, C, F, H, W) raw VAE latents (not normalized)
      -> conv 3x3(x3) -> GroupNorm(32) -> SiLU -> N residual blocks      (mid channels)
      -> per frame: conv 3x3 to s^2 x mid, depth-to-space by s, then (rational scale) a
         binomial 5x5 blur with stride d                                  (H, W) * s / d
         (temporal: conv 3x3x3 to 2 x mid, depth-to-time, the first frame dropped)
      -> N residual blocks -> conv to C                                  (B, C, F, H', W')

A residual block: conv -> GroupNorm -> SiLU -> conv -> GroupNorm -> SiLU(+ input).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.diffusers_loader import build_from_folder, config_from_dict, read_config

# diffusers' rational scales: (upsample by, then blur-downsample by)
RATIONAL = {0.75: (3, 4), 1.5: (3, 2), 2.0: (2, 1), 4.0: (4, 1)}


@dataclass(frozen=True, slots=True)
class LTX2LatentUpsamplerConfig:
    """config.json of a diffusers `LTX2LatentUpsamplerModel` folder (its keys, its defaults)."""
    in_channels: int = 128
    mid_channels: int = 1024
    num_blocks_per_stage: int = 4
    dims: int = 3
    spatial_upsample: bool = True
    temporal_upsample: bool = False
    rational_spatial_scale: float = 2.0
    use_rational_resampler: bool = True

    def __post_init__(self) -> None:
        if self.dims not in (2, 3):
            raise ValueError(f"LTX2LatentUpsamplerModel config: dims={self.dims} (2 or 3)")
        if not (self.spatial_upsample or self.temporal_upsample):
            raise ValueError("LTX2LatentUpsamplerModel config: neither spatial_upsample nor "
                             "temporal_upsample")
        if self.spatial_upsample and self.use_rational_resampler \
                and self.rational_spatial_scale not in RATIONAL:
            raise ValueError(f"LTX2LatentUpsamplerModel config: rational_spatial_scale="
                             f"{self.rational_spatial_scale} (one of {sorted(RATIONAL)})")

    @property
    def spatial_factor(self) -> float:
        """How much H and W grow."""
        if not self.spatial_upsample:
            return 1.0
        return self.rational_spatial_scale if self.use_rational_resampler else 2.0


def depth_to_space(x: Tensor, factors: tuple[int, ...]) -> Tensor:
    """(B, C * prod(f), S1, ..., Sm) -> (B, C, S1 * f1, ..., Sk * fk, ..., Sm): the first
    k = len(factors) axes after the channels grow, each factor's channels interleaved into
    its axis (diffusers' PixelShuffleND)."""
    k = len(factors)
    x = x.unflatten(1, (-1, *factors))                     # (B, C, f1..fk, S1..Sm)
    m = x.dim() - 2 - k
    order = [0, 1]
    for i in range(k):
        order += [2 + k + i, 2 + i]
    order += [2 + k + j for j in range(k, m)]
    x = x.permute(order)
    for i in range(k):
        x = x.flatten(2 + i, 3 + i)
    return x


def blur_downsample(x: Tensor, stride: int, size: int = 5) -> Tensor:
    """(B, C, H, W) blurred with the normalized binomial size x size kernel, depthwise, and
    strided by `stride` (1: unchanged)."""
    if stride == 1:
        return x
    k = torch.tensor([math.comb(size - 1, i) for i in range(size)], dtype=torch.float32)
    k2 = (k[:, None] * k[None, :]) / (k.sum() ** 2)
    weight = k2.to(x.dtype).to(x.device).expand(x.shape[1], 1, size, size)
    return F.conv2d(x, weight, stride=stride, padding=size // 2, groups=x.shape[1])


class ResBlock(nn.Module):
    def __init__(self, channels: int, dims: int) -> None:
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        self.conv1 = conv(channels, channels, kernel_size=3, padding=1)
        self.norm1 = nn.GroupNorm(32, channels)
        self.conv2 = conv(channels, channels, kernel_size=3, padding=1)
        self.norm2 = nn.GroupNorm(32, channels)

    def forward(self, x: Tensor) -> Tensor:
        h = F.silu(self.norm1(self.conv1(x)))
        return F.silu(self.norm2(self.conv2(h)) + x)


class RationalResampler(nn.Module):
    """Per frame (B*F, C, H, W): conv to num^2 x C, depth-to-space by num, blur-stride by den."""

    def __init__(self, channels: int, scale: float) -> None:
        super().__init__()
        self.num, self.den = RATIONAL[scale]
        self.conv = nn.Conv2d(channels, self.num ** 2 * channels, kernel_size=3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return blur_downsample(depth_to_space(self.conv(x), (self.num, self.num)), self.den)


class ConvShuffle(nn.Sequential):
    """diffusers' `Sequential(conv, PixelShuffleND)`: its conv is tensor `0`."""

    def __init__(self, conv: nn.Module, factors: tuple[int, ...]) -> None:
        super().__init__(conv)
        self.factors = factors

    def forward(self, x: Tensor) -> Tensor:
        return depth_to_space(self[0](x), self.factors)


class LTX2LatentUpsampler(nn.Module):
    # diffusers saves the blur's fixed kernel (a buffer); it is recomputed here
    ignored_tensors = ("blur_down",)

    def __init__(self, cfg: LTX2LatentUpsamplerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        mid, dims = cfg.mid_channels, cfg.dims
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        self.initial_conv = conv(cfg.in_channels, mid, kernel_size=3, padding=1)
        self.initial_norm = nn.GroupNorm(32, mid)
        self.res_blocks = nn.ModuleList(ResBlock(mid, dims)
                                        for _ in range(cfg.num_blocks_per_stage))
        if cfg.spatial_upsample and cfg.temporal_upsample:
            self.upsampler: nn.Module = ConvShuffle(nn.Conv3d(mid, 8 * mid, 3, padding=1),
                                                    (2, 2, 2))
        elif cfg.spatial_upsample and cfg.use_rational_resampler:
            self.upsampler = RationalResampler(mid, cfg.rational_spatial_scale)
        elif cfg.spatial_upsample:
            self.upsampler = ConvShuffle(nn.Conv2d(mid, 4 * mid, 3, padding=1), (2, 2))
        else:
            self.upsampler = ConvShuffle(nn.Conv3d(mid, 2 * mid, 3, padding=1), (2,))
        self.post_upsample_res_blocks = nn.ModuleList(ResBlock(mid, dims)
                                                      for _ in range(cfg.num_blocks_per_stage))
        self.final_conv = conv(mid, cfg.in_channels, kernel_size=3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, F, H, W) raw latents -> (B, C, F', H', W')."""
        if x.dim() != 5:
            raise ValueError(f"latents: expected (B, C, F, H, W), got {tuple(x.shape)}")
        b = x.shape[0]
        per_frame = self.cfg.dims == 2
        if per_frame:
            x = x.transpose(1, 2).flatten(0, 1)
        x = F.silu(self.initial_norm(self.initial_conv(x)))
        for block in self.res_blocks:
            x = block(x)
        if per_frame:
            x = self.upsampler(x)
        elif self.cfg.temporal_upsample:
            x = self.upsampler(x)[:, :, 1:]
        else:
            x = self.upsampler(x.transpose(1, 2).flatten(0, 1))
            x = x.unflatten(0, (b, -1)).transpose(1, 2)
        for block in self.post_upsample_res_blocks:
            x = block(x)
        x = self.final_conv(x)
        return x.unflatten(0, (b, -1)).transpose(1, 2) if per_frame else x

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> LTX2LatentUpsampler:
        """A diffusers `latent_upsampler/` folder in `dtype` (None: the checkpoint's)."""
        path = Path(path)
        cfg = config_from_dict(LTX2LatentUpsamplerConfig, read_config(path),
                               "LTX2LatentUpsamplerModel")
        return build_from_folder(cls, cfg, path, device, dtype)
