"""LTX-2's audio VAE: diffusers' `AutoencoderKLLTX2Audio` in plain PyTorch, a 2D conv VAE over
mel spectrograms (time x mel bins), causal along time in LTX-2 (`causality_axis: height`).

    mel (B, C, T, M) -> conv_in -> down levels (res blocks, attn, stride-2 conv) -> mid
        -> norm, silu, conv_out -> [mean | logvar] (B, 2z, T/4, M/4)
    latents (B, z, t, m) -> conv_in -> mid -> up levels (res blocks, attn, nearest x2 + conv)
        -> norm, silu, conv_out -> mel (B, C, 4t - 3, mel_bins), cropped or zero-padded

The diffusion model sees the latents packed as (B, t, z m) (`pack`), normalized per packed
feature by the checkpoint's `latents_mean` / `latents_std` (`normalize` / `denormalize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.diffusers_loader import build_from_folder, config_from_dict, read_config

DOWNSAMPLE = 4          # time and mel bins per latent (diffusers' LATENT_DOWNSAMPLE_FACTOR)
_AXES = ("none", "width", "height", "width-compatibility")


@dataclass(frozen=True, slots=True)
class AutoencoderKLLTX2AudioConfig:
    """config.json of a diffusers `AutoencoderKLLTX2Audio` folder (its keys, its defaults)."""
    base_channels: int = 128
    output_channels: int = 2
    ch_mult: tuple[int, ...] = (1, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] | None = None
    in_channels: int = 2
    resolution: int = 256
    latent_channels: int = 8
    norm_type: str = "pixel"
    causality_axis: str = "height"
    dropout: float = 0.0                       # inference: unused
    mid_block_add_attention: bool = False
    sample_rate: int = 16000
    mel_hop_length: int = 160
    is_causal: bool = True
    mel_bins: int | None = 64
    double_z: bool = True

    def __post_init__(self) -> None:
        if self.causality_axis not in _AXES:
            raise ValueError(f"causality_axis: {self.causality_axis!r} is not one of {_AXES}")
        if self.norm_type not in ("group", "pixel"):
            raise ValueError(f"norm_type: {self.norm_type!r} is not 'group' or 'pixel'")
        if self.norm_type == "group" and self.causality_axis != "none":
            raise ValueError("norm_type 'group' needs causality_axis 'none' (as diffusers)")


def _padding(kernel: int, axis: str) -> tuple[int, int, int, int]:
    """F.pad's (left, right, top, bottom) for a k x k conv: causal along `axis`."""
    p = kernel - 1
    if axis == "height":
        return (p // 2, p - p // 2, p, 0)
    if axis in ("width", "width-compatibility"):
        return (p, 0, p // 2, p - p // 2)
    return (p // 2, p - p // 2, p // 2, p - p // 2)


class CausalConv2d(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel: int, axis: str) -> None:
        super().__init__()
        self.padding = _padding(kernel, axis)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, self.padding))


def _norm(channels: int, norm_type: str) -> nn.Module:
    """diffusers' names: a GroupNorm's weight sits at `norm1.weight`, so it is the module."""
    if norm_type == "group":
        return nn.GroupNorm(32, channels, eps=1e-6)
    return PixelNorm()


class PixelNorm(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x / torch.sqrt(torch.mean(x * x, dim=1, keepdim=True) + 1e-6)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, norm_type: str, axis: str) -> None:
        super().__init__()
        self.norm1 = _norm(in_channels, norm_type)
        self.conv1 = CausalConv2d(in_channels, out_channels, 3, axis)
        self.norm2 = _norm(out_channels, norm_type)
        self.conv2 = CausalConv2d(out_channels, out_channels, 3, axis)
        self.nin_shortcut = (CausalConv2d(in_channels, out_channels, 1, axis)
                             if in_channels != out_channels else None)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.nin_shortcut(x) if self.nin_shortcut is not None else x) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all (time, mel) positions, 1x1 conv projections."""

    def __init__(self, channels: int, norm_type: str) -> None:
        super().__init__()
        self.norm = _norm(channels, norm_type)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1)
                                                 for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        n = self.norm(x)
        q, k, v = (proj(n).reshape(b, 1, c, h * w).transpose(2, 3)
                   for proj in (self.q, self.k, self.v))           # (B, 1, hw, C)
        out = F.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(b, c, h, w)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    _PAD = {"none": (0, 1, 0, 1), "width": (2, 0, 0, 1), "height": (0, 1, 2, 0),
            "width-compatibility": (1, 0, 0, 1)}

    def __init__(self, channels: int, axis: str) -> None:
        super().__init__()
        self.pad = self._PAD[axis]
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, self.pad))


class Upsample(nn.Module):
    def __init__(self, channels: int, axis: str) -> None:
        super().__init__()
        self.axis = axis
        self.conv = CausalConv2d(channels, channels, 3, axis)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        if self.axis == "height":            # drop the causal padding's extra first row
            return x[:, :, 1:]
        return x[:, :, :, 1:] if self.axis == "width" else x


class Level(nn.Module):
    """One resolution: res blocks (each followed by an attention block at attention
    resolutions) and a resampler (`downsample` or `upsample`), named as diffusers'."""

    def __init__(self, channels: list[int], attn: bool, norm_type: str, axis: str) -> None:
        super().__init__()
        self.block = nn.ModuleList(ResnetBlock(a, b, norm_type, axis)
                                   for a, b in zip(channels, channels[1:]))
        self.attn = nn.ModuleList(AttnBlock(c, norm_type) for c in channels[1:] if attn)

    def forward(self, x: Tensor) -> Tensor:
        for i, block in enumerate(self.block):
            x = block(x)
            if len(self.attn):
                x = self.attn[i](x)
        return x


class Mid(nn.Module):
    def __init__(self, channels: int, attn: bool, norm_type: str, axis: str) -> None:
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, norm_type, axis)
        self.attn_1 = AttnBlock(channels, norm_type) if attn else nn.Identity()
        self.block_2 = ResnetBlock(channels, channels, norm_type, axis)

    def forward(self, x: Tensor) -> Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class Encoder(nn.Module):
    def __init__(self, cfg: AutoencoderKLLTX2AudioConfig) -> None:
        super().__init__()
        axis, norm = cfg.causality_axis, cfg.norm_type
        attn_at = set(cfg.attn_resolutions or ())
        self.conv_in = CausalConv2d(cfg.in_channels, cfg.base_channels, 3, axis)
        channels, res = cfg.base_channels, cfg.resolution
        levels = []
        for i, mult in enumerate(cfg.ch_mult):
            out = cfg.base_channels * mult
            level = Level([channels] + [out] * cfg.num_res_blocks, res in attn_at, norm, axis)
            if i != len(cfg.ch_mult) - 1:
                level.downsample = Downsample(out, axis)
                res //= 2
            levels.append(level)
            channels = out
        self.down = nn.ModuleList(levels)
        self.mid = Mid(channels, cfg.mid_block_add_attention, norm, axis)
        self.norm_out = _norm(channels, norm)
        z = cfg.latent_channels * (2 if cfg.double_z else 1)
        self.conv_out = CausalConv2d(channels, z, 3, axis)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_in(x)
        for level in self.down:
            x = level(x)
            if hasattr(level, "downsample"):
                x = level.downsample(x)
        return self.conv_out(F.silu(self.norm_out(self.mid(x))))


class Decoder(nn.Module):
    def __init__(self, cfg: AutoencoderKLLTX2AudioConfig) -> None:
        super().__init__()
        axis, norm, n = cfg.causality_axis, cfg.norm_type, len(cfg.ch_mult)
        attn_at = set(cfg.attn_resolutions or ())
        channels = cfg.base_channels * cfg.ch_mult[-1]
        res = cfg.resolution // 2 ** (n - 1)
        self.conv_in = CausalConv2d(cfg.latent_channels, channels, 3, axis)
        self.mid = Mid(channels, cfg.mid_block_add_attention, norm, axis)
        levels: list[Level] = []
        for i in reversed(range(n)):
            out = cfg.base_channels * cfg.ch_mult[i]
            level = Level([channels] + [out] * (cfg.num_res_blocks + 1), res in attn_at, norm,
                          axis)
            if i != 0:
                level.upsample = Upsample(out, axis)
                res *= 2
            levels.insert(0, level)
            channels = out
        self.up = nn.ModuleList(levels)
        self.norm_out = _norm(channels, norm)
        self.conv_out = CausalConv2d(channels, cfg.output_channels, 3, axis)

    def forward(self, z: Tensor) -> Tensor:
        x = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            x = level(x)
            if hasattr(level, "upsample"):
                x = level.upsample(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class AutoencoderKLLTX2Audio(nn.Module):
    """Mel spectrograms to latents and back; `from_pretrained` loads a diffusers `audio_vae/`."""

    def __init__(self, cfg: AutoencoderKLLTX2AudioConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        # persistent buffers in diffusers: parameters here, read by the strict loader
        self.latents_mean = nn.Parameter(torch.zeros(cfg.base_channels), requires_grad=False)
        self.latents_std = nn.Parameter(torch.ones(cfg.base_channels), requires_grad=False)

    def encode(self, mel: Tensor) -> Tensor:
        """mel (B, C, T, M) -> posterior mean (B, z, t, m), raw."""
        _check_4d(mel, "mel", self.cfg.in_channels)
        return self.encoder(mel)[:, :self.cfg.latent_channels]

    def decode(self, latents: Tensor) -> Tensor:
        """raw latents (B, z, t, m) -> mel (B, C, max(4t - 3, 1), mel_bins or 4m)."""
        _check_4d(latents, "latents", self.cfg.latent_channels)
        frames, bins = latents.shape[2:]
        num_frames = max(frames * DOWNSAMPLE - (DOWNSAMPLE - 1), 1)
        num_bins = self.cfg.mel_bins if self.cfg.mel_bins is not None else bins
        mel = self.decoder(latents)[:, :, :num_frames, :num_bins]
        return F.pad(mel, (0, num_bins - mel.shape[3], 0, num_frames - mel.shape[2]))

    @property
    def latent_mel_bins(self) -> int:
        return (self.cfg.mel_bins or 64) // DOWNSAMPLE

    # ---- the diffusion model's view: packed (B, t, z m), normalized per feature ----

    @staticmethod
    def pack(latents: Tensor) -> Tensor:          # (B, z, t, m) -> (B, t, z m)
        b, z, t, m = latents.shape
        return latents.permute(0, 2, 1, 3).reshape(b, t, z * m)

    def unpack(self, packed: Tensor) -> Tensor:   # (B, t, z m) -> (B, z, t, m)
        b, t, _ = packed.shape
        return packed.reshape(b, t, -1, self.latent_mel_bins).permute(0, 2, 1, 3)

    def normalize(self, packed: Tensor) -> Tensor:
        mean, std = (s.to(packed.device, packed.dtype) for s in (self.latents_mean,
                                                                 self.latents_std))
        return (packed - mean) / std

    def denormalize(self, packed: Tensor) -> Tensor:
        mean, std = (s.to(packed.device, packed.dtype) for s in (self.latents_mean,
                                                                 self.latents_std))
        return packed * std + mean

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> AutoencoderKLLTX2Audio:
        """Build from a diffusers `audio_vae/` folder in `dtype` (None: the checkpoint's).
        Missing, unexpected or mis-shaped tensors raise ValueError naming them."""
        path = Path(path)
        cfg = config_from_dict(AutoencoderKLLTX2AudioConfig, read_config(path),
                               "AutoencoderKLLTX2Audio")
        return build_from_folder(cls, cfg, path, device, dtype)


def _check_4d(x: Tensor, name: str, channels: int) -> None:
    if x.dim() != 4 or x.shape[1] != channels:
        raise ValueError(f"{name}: expected (B, {channels}, time, mel bins), got "
                         f"{tuple(x.shape)}")
