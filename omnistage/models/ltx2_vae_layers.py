"""The blocks of LTX-2's video VAE (`autoencoder_kl_ltx2.py`), named as diffusers'
`AutoencoderKLLTX2Video` names its tensors.

Every conv is a 3x3x3 conv padded in H and W by the conv itself (zeros or reflect) and in time
by repeating edge frames: causal (frame 0 repeated k-1 times in front) or symmetric (the first
and the last frame (k-1)/2 times each side). Norms are per-pixel RMS over channels; resampling
is space-to-depth (down) and depth-to-space (up), each with a parameter-free residual path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.dit import TimestepEmbedding, timestep_embedding


def pixel_norm(x: Tensor, eps: float = 1e-8) -> Tensor:
    """x / rms over channels (dim 1), per pixel; no weight."""
    return x / torch.sqrt(torch.mean(x * x, dim=1, keepdim=True) + eps)


class CausalConv3d(nn.Module):
    """(B, C, T, H, W) -> (B, C', T', H', W'): H/W padded by the conv, T by edge frames."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3,
                 stride: int | tuple[int, int, int] = 1, padding_mode: str = "zeros") -> None:
        super().__init__()
        self.kernel_t = kernel_size
        stride = stride if isinstance(stride, tuple) else (stride,) * 3
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size, stride=stride,
                              padding=(0, kernel_size // 2, kernel_size // 2),
                              padding_mode=padding_mode)

    def forward(self, x: Tensor, causal: bool) -> Tensor:
        k = self.kernel_t - 1
        if causal:
            x = torch.cat([x[:, :, :1].expand(-1, -1, k, -1, -1), x], dim=2)
        else:
            x = torch.cat([x[:, :, :1].expand(-1, -1, k // 2, -1, -1), x,
                           x[:, :, -1:].expand(-1, -1, k // 2, -1, -1)], dim=2)
        return self.conv(x)


class TimeEmbedder(nn.Module):
    """diffusers' PixArtAlphaCombinedTimestepSizeEmbeddings(dim, 0): sinusoid(256) -> MLP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, dim)

    def forward(self, t: Tensor, like: Tensor) -> Tensor:     # t (B,) -> (B, dim, 1, 1, 1)
        emb = self.timestep_embedder(timestep_embedding(t.flatten()).to(like.dtype))
        return emb.view(like.shape[0], -1, 1, 1, 1)


def _spatial_noise(x: Tensor, scale: Tensor) -> Tensor:
    """x + one (H, W) draw of the global RNG scaled per channel, as diffusers' injected noise."""
    noise = torch.randn(x.shape[-2:], device=x.device, dtype=x.dtype)[None]
    return x + (noise * scale)[None, :, None]


class ResnetBlock3d(nn.Module):
    """norm, (modulate), silu, conv, (noise), twice; a LayerNorm + 1x1x1 conv shortcut when
    the width changes. `temb` is the block's embedded timestep (B, 4C, 1, 1, 1)."""

    def __init__(self, in_channels: int, out_channels: int, eps: float = 1e-6,
                 inject_noise: bool = False, timestep_conditioning: bool = False,
                 padding_mode: str = "zeros") -> None:
        super().__init__()
        self.conv1 = CausalConv3d(in_channels, out_channels, padding_mode=padding_mode)
        self.conv2 = CausalConv3d(out_channels, out_channels, padding_mode=padding_mode)
        self.norm3: nn.LayerNorm | None = None
        self.conv_shortcut: nn.Conv3d | None = None
        if in_channels != out_channels:
            self.norm3 = nn.LayerNorm(in_channels, eps=eps)
            self.conv_shortcut = nn.Conv3d(in_channels, out_channels, 1)
        self.per_channel_scale1: nn.Parameter | None = None
        self.per_channel_scale2: nn.Parameter | None = None
        if inject_noise:
            self.per_channel_scale1 = nn.Parameter(torch.zeros(in_channels, 1, 1))
            self.per_channel_scale2 = nn.Parameter(torch.zeros(in_channels, 1, 1))
        self.scale_shift_table: nn.Parameter | None = None
        if timestep_conditioning:
            self.scale_shift_table = nn.Parameter(torch.zeros(4, in_channels))

    def forward(self, x: Tensor, temb: Tensor | None, causal: bool) -> Tensor:
        h = pixel_norm(x)
        if self.scale_shift_table is not None:
            assert temb is not None, "a timestep-conditioned block needs temb"
            mod = temb.unflatten(1, (4, -1)) + self.scale_shift_table[None, ..., None, None, None]
            shift1, scale1, shift2, scale2 = mod.unbind(dim=1)
            h = h * (1 + scale1) + shift1
        h = self.conv1(F.silu(h), causal)
        if self.per_channel_scale1 is not None:
            h = _spatial_noise(h, self.per_channel_scale1)
        h = pixel_norm(h)
        if self.scale_shift_table is not None:
            h = h * (1 + scale2) + shift2
        h = self.conv2(F.silu(h), causal)
        if self.per_channel_scale2 is not None:
            h = _spatial_noise(h, self.per_channel_scale2)
        if self.norm3 is not None and self.conv_shortcut is not None:
            x = self.conv_shortcut(self.norm3(x.movedim(1, -1)).movedim(-1, 1))
        return h + x


def space_to_depth(x: Tensor, stride: tuple[int, int, int]) -> Tensor:
    """(B, C, T, H, W) -> (B, C st sh sw, T/st, H/sh, W/sw), channel order (c, st, sh, sw)."""
    b, c, t, h, w = x.shape
    st, sh, sw = stride
    x = x.reshape(b, c, t // st, st, h // sh, sh, w // sw, sw).permute(0, 1, 3, 5, 7, 2, 4, 6)
    return x.reshape(b, c * st * sh * sw, t // st, h // sh, w // sw)


def depth_to_space(x: Tensor, stride: tuple[int, int, int]) -> Tensor:
    """The inverse of `space_to_depth`, then the first st - 1 frames dropped (causal)."""
    b, _, t, h, w = x.shape
    st, sh, sw = stride
    x = x.reshape(b, -1, st, sh, sw, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    return x.reshape(b, -1, t * st, h * sh, w * sw)[:, :, st - 1:]


class Downsampler3d(nn.Module):
    """conv to out/(st sh sw) channels, space-to-depth, plus the input's space-to-depth
    averaged over groups of channels; the first st - 1 frames are repeated in front."""

    def __init__(self, in_channels: int, out_channels: int, stride: tuple[int, int, int],
                 padding_mode: str = "zeros") -> None:
        super().__init__()
        self.stride = stride
        n = stride[0] * stride[1] * stride[2]
        self.group_size = in_channels * n // out_channels
        self.conv = CausalConv3d(in_channels, out_channels // n, padding_mode=padding_mode)

    def forward(self, x: Tensor, causal: bool) -> Tensor:
        x = torch.cat([x[:, :, :self.stride[0] - 1], x], dim=2)
        residual = space_to_depth(x, self.stride)
        residual = residual.unflatten(1, (-1, self.group_size)).mean(dim=2)
        return space_to_depth(self.conv(x, causal), self.stride) + residual


class Upsampler3d(nn.Module):
    """conv to C st sh sw / f channels, depth-to-space; with `residual`, plus the input's
    depth-to-space repeated over channels."""

    def __init__(self, in_channels: int, stride: tuple[int, int, int], residual: bool,
                 upscale_factor: int, padding_mode: str = "zeros") -> None:
        super().__init__()
        self.stride = stride
        self.residual = residual
        self.repeats = stride[0] * stride[1] * stride[2] // upscale_factor
        self.conv = CausalConv3d(in_channels, in_channels * self.repeats,
                                 padding_mode=padding_mode)

    def forward(self, x: Tensor, causal: bool) -> Tensor:
        out = depth_to_space(self.conv(x, causal), self.stride)
        if self.residual:
            out = out + depth_to_space(x, self.stride).repeat(1, self.repeats, 1, 1, 1)
        return out


_DOWN_STRIDES = {"spatial": (1, 2, 2), "temporal": (2, 1, 1), "spatiotemporal": (2, 2, 2)}


class DownBlock3D(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, num_layers: int, eps: float,
                 scale: bool, downsample_type: str, padding_mode: str) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock3d(in_channels, in_channels, eps,
                                                   padding_mode=padding_mode)
                                     for _ in range(num_layers))
        self.downsamplers: nn.ModuleList | None = None
        if scale:
            if downsample_type == "conv":
                down: nn.Module = CausalConv3d(in_channels, in_channels, stride=(2, 2, 2),
                                               padding_mode=padding_mode)
            elif downsample_type in _DOWN_STRIDES:
                down = Downsampler3d(in_channels, out_channels, _DOWN_STRIDES[downsample_type],
                                     padding_mode)
            else:
                raise ValueError(f"downsample_type: unknown {downsample_type!r}")
            self.downsamplers = nn.ModuleList([down])

    def forward(self, x: Tensor, causal: bool) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x, None, causal)
        for down in self.downsamplers or ():
            x = down(x, causal)
        return x


class MidBlock3d(nn.Module):
    def __init__(self, channels: int, num_layers: int, eps: float, inject_noise: bool = False,
                 timestep_conditioning: bool = False, padding_mode: str = "zeros") -> None:
        super().__init__()
        self.time_embedder = TimeEmbedder(channels * 4) if timestep_conditioning else None
        self.resnets = nn.ModuleList(
            ResnetBlock3d(channels, channels, eps, inject_noise, timestep_conditioning,
                          padding_mode) for _ in range(num_layers))

    def forward(self, x: Tensor, t: Tensor | None, causal: bool) -> Tensor:
        temb = self.time_embedder(t, x) if self.time_embedder is not None else None
        for resnet in self.resnets:
            x = resnet(x, temb, causal)
        return x


_UP_STRIDES = {"spatial": (1, 2, 2), "temporal": (2, 1, 1), "spatiotemporal": (2, 2, 2)}


class UpBlock3d(nn.Module):
    """(conv_in resnet when the width changes), upsampler, resnets; its own time embedder."""

    def __init__(self, in_channels: int, out_channels: int, num_layers: int, eps: float,
                 scale: bool, upsample_type: str, inject_noise: bool,
                 timestep_conditioning: bool, residual: bool, upscale_factor: int,
                 padding_mode: str) -> None:
        super().__init__()
        self.time_embedder = TimeEmbedder(in_channels * 4) if timestep_conditioning else None
        self.conv_in: ResnetBlock3d | None = None
        if in_channels != out_channels:
            self.conv_in = ResnetBlock3d(in_channels, out_channels, eps, inject_noise,
                                         timestep_conditioning, padding_mode)
        self.upsamplers: nn.ModuleList | None = None
        if scale:
            if upsample_type not in _UP_STRIDES:
                raise ValueError(f"upsample_type: unknown {upsample_type!r}")
            self.upsamplers = nn.ModuleList([Upsampler3d(
                out_channels * upscale_factor, _UP_STRIDES[upsample_type], residual,
                upscale_factor, padding_mode)])
        self.resnets = nn.ModuleList(
            ResnetBlock3d(out_channels, out_channels, eps, inject_noise, timestep_conditioning,
                          padding_mode) for _ in range(num_layers))

    def forward(self, x: Tensor, t: Tensor | None, causal: bool) -> Tensor:
        if self.conv_in is not None:       # diffusers hands it the raw timestep, as here
            x = self.conv_in(x, t, causal)
        temb = self.time_embedder(t, x) if self.time_embedder is not None else None
        for up in self.upsamplers or ():
            x = up(x, causal)
        for resnet in self.resnets:
            x = resnet(x, temb, causal)
        return x
