"""HunyuanVideo-1.5's latent upsamplers: the first half of its super-resolution pass (the
upstream repository's `hyvideo/models/transformers/modules/upsample.py`), read from a released
`upsampler/<version>/` folder (config.json + diffusion_pytorch_model.safetensors, the
upstream's tensor names kept). Both run on VAE latents already resized bilinearly to the
target grid (hunyuan_video15_sr.py does that); every convolution is causal in time
(hunyuan_video15_vae_layers.CausalConv3d).

    SRTo720pUpsampler   (480p -> 720p)      latents (B, C, F, h, w)
        in_conv -> num_blocks x [conv, SiLU, conv, SiLU, conv (+ input)] -> out_conv
        (+ the input where global_residual and the shapes agree)

    SRTo1080pUpsampler  (720p -> 1080p)
        conv_in (+ the input's channels repeated to block_out_channels[0])
        -> per level of block_out_channels: num_res_blocks + 1 VAE resnet blocks
        -> RMS norm -> SiLU -> conv_out
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.diffusers_loader import build_from_folder, config_from_dict
from omnistage.models.hunyuan_video15_vae_layers import CausalConv3d, RMSNorm


@dataclass(frozen=True, slots=True)
class SRTo720pUpsamplerConfig:
    in_channels: int = 32
    out_channels: int = 32
    hidden_channels: int | None = None      # the upstream's default: 64
    num_blocks: int = 6
    global_residual: bool = False

    @property
    def width(self) -> int:
        return 64 if self.hidden_channels is None else self.hidden_channels


@dataclass(frozen=True, slots=True)
class SRTo1080pUpsamplerConfig:
    z_channels: int = 32
    out_channels: int = 32
    block_out_channels: tuple[int, ...] = (64,)
    num_res_blocks: int = 2
    is_residual: bool = False               # read by nothing in the upstream forward

    def __post_init__(self) -> None:
        if self.block_out_channels[0] % self.z_channels:
            raise ValueError(f"SRTo1080pUpsampler config: block_out_channels[0]="
                             f"{self.block_out_channels[0]} must be a multiple of z_channels="
                             f"{self.z_channels}")


class SRResidualCausalBlock3D(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.block = nn.Sequential(CausalConv3d(channels, channels), nn.SiLU(),
                                   CausalConv3d(channels, channels), nn.SiLU(),
                                   CausalConv3d(channels, channels))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.block(x)


class SRTo720pUpsampler(nn.Module):
    def __init__(self, cfg: SRTo720pUpsamplerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.in_conv = CausalConv3d(cfg.in_channels, cfg.width)
        self.blocks = nn.ModuleList([SRResidualCausalBlock3D(cfg.width)
                                     for _ in range(cfg.num_blocks)])
        self.out_conv = CausalConv3d(cfg.width, cfg.out_channels)

    def forward(self, x: Tensor) -> Tensor:                            # (B, C, F, h, w)
        y = self.in_conv(x)
        for block in self.blocks:
            y = block(y)
        y = self.out_conv(y)
        return y + x if self.cfg.global_residual and y.shape == x.shape else y


class SRResnetBlock(nn.Module):
    """The VAE's resnet block under the upstream's names (`nin_shortcut`)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(in_channels)
        self.conv1 = CausalConv3d(in_channels, out_channels)
        self.norm2 = RMSNorm(out_channels)
        self.conv2 = CausalConv3d(out_channels, out_channels)
        self.nin_shortcut = (nn.Conv3d(in_channels, out_channels, 1)
                             if in_channels != out_channels else None)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))
        return h + (x if self.nin_shortcut is None else self.nin_shortcut(x))


class SRTo1080pUpsampler(nn.Module):
    def __init__(self, cfg: SRTo1080pUpsamplerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        width = cfg.block_out_channels[0]
        self.conv_in = CausalConv3d(cfg.z_channels, width)
        self.up = nn.ModuleList()
        for channels in cfg.block_out_channels:
            level = nn.Module()
            level.block = nn.ModuleList()
            for _ in range(cfg.num_res_blocks + 1):
                level.block.append(SRResnetBlock(width, channels))
                width = channels
            self.up.append(level)
        self.norm_out = RMSNorm(width)
        self.conv_out = CausalConv3d(width, cfg.out_channels)

    def forward(self, z: Tensor) -> Tensor:                            # (B, C, F, h, w)
        repeats = self.cfg.block_out_channels[0] // self.cfg.z_channels
        h = self.conv_in(z) + z.repeat_interleave(repeats, dim=1)
        for level in self.up:
            for block in level.block:
                h = block(h)
        return self.conv_out(F.silu(self.norm_out(h)))


UPSAMPLERS = {"SRTo720pUpsampler": (SRTo720pUpsampler, SRTo720pUpsamplerConfig),
              "SRTo1080pUpsampler": (SRTo1080pUpsampler, SRTo1080pUpsamplerConfig)}


def load_upsampler(path: str | Path, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> SRTo720pUpsampler | SRTo1080pUpsampler:
    """A released `upsampler/<version>/` folder, by its config's `_class_name` (float32, as the
    upstream SR pipeline runs it)."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{path}: no config.json (not an upsampler folder)")
    raw = json.loads(config.read_text())
    name = raw.get("_class_name")
    if name not in UPSAMPLERS:
        raise ValueError(f"{config}: _class_name {name!r} is not a HunyuanVideo-1.5 "
                         f"upsampler (one of {sorted(UPSAMPLERS)})")
    model_cls, cfg_cls = UPSAMPLERS[name]
    cfg = config_from_dict(cfg_cls, {k: v for k, v in raw.items() if not k.startswith("_")},
                           name)
    return build_from_folder(model_cls, cfg, path, device, dtype)
