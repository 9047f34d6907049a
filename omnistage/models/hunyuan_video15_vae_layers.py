"""The blocks of HunyuanVideo-1.5's video VAE (autoencoder_kl_hunyuan_video15.py), with
diffusers' parameter names.

Every 3D convolution is causal in time: the input is padded with copies of its first frame
(k - 1 before, none after) and by k // 2 copies of the edge in H and W, so frame t never
sees a later frame. The whole clip goes through at once (no chunk cache, unlike Wan's VAE).

Resampling is DC-AE style: a convolution to few channels, then space (and time) folded into
channels or unfolded out of them, plus a parameter-free shortcut (a channel-group mean down,
a channel repeat up). Frame 0 is resampled alone in space; frames 1.. go in pairs in time:

    down, in time:  T = 1 + 2k frames -> 1 + k      up, in time:  1 + k -> 1 + 2k
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CausalConv3d(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3) -> None:
        super().__init__()
        k = kernel_size
        self.padding = (k // 2, k // 2, k // 2, k // 2, k - 1, 0)   # (W, W, H, H, T before, after)
        self.conv = nn.Conv3d(in_channels, out_channels, k)

    def forward(self, x: Tensor) -> Tensor:                            # (B, C, T, H, W)
        return self.conv(F.pad(x, self.padding, mode="replicate"))


class RMSNorm(nn.Module):
    """x / ||x|| over channels * sqrt(C) * gamma, the norm in float32 for half precision."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim, 1, 1, 1))

    def forward(self, x: Tensor) -> Tensor:                            # (B, C, T, H, W)
        wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return F.normalize(wide, dim=1).to(x.dtype) * self.scale * self.gamma


class AttnBlock(nn.Module):
    """One-head self-attention over all T*H*W positions; a position sees every position of
    its own frame and of the frames before it (frame-causal). Run frame by frame: the
    queries of frame t against the keys of frames 0..t, with no mask to build."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = RMSNorm(channels)
        self.to_q = nn.Conv3d(channels, channels, 1)
        self.to_k = nn.Conv3d(channels, channels, 1)
        self.to_v = nn.Conv3d(channels, channels, 1)
        self.proj_out = nn.Conv3d(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:                            # (B, C, T, H, W)
        b, c, t, h, w = x.shape
        y = self.norm(x)
        q, k, v = (proj(y).flatten(2).transpose(1, 2) for proj in (self.to_q, self.to_k,
                                                                   self.to_v))  # (B, THW, C)
        hw = h * w
        out = torch.cat([F.scaled_dot_product_attention(q[:, i * hw:(i + 1) * hw],
                                                        k[:, :(i + 1) * hw], v[:, :(i + 1) * hw])
                         for i in range(t)], dim=1)                       # (B, THW, C)
        out = out.transpose(1, 2).reshape(b, c, t, h, w)
        return x + self.proj_out(out)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(in_channels)
        self.conv1 = CausalConv3d(in_channels, out_channels)
        self.norm2 = RMSNorm(out_channels)
        self.conv2 = CausalConv3d(out_channels, out_channels)
        self.conv_shortcut = (nn.Conv3d(in_channels, out_channels, 1)
                              if in_channels != out_channels else None)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + (x if self.conv_shortcut is None else self.conv_shortcut(x))


class MidBlock(nn.Module):
    """resnet, attention, resnet."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(channels, channels) for _ in range(2)])
        self.attentions = nn.ModuleList([AttnBlock(channels)])

    def forward(self, x: Tensor) -> Tensor:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


def fold(x: Tensor, rt: int) -> Tensor:
    """(B, C, rt T, 2H, 2W) -> (B, rt*2*2*C, T, H, W), channel order (rt, rh, rw, C)."""
    b, c, t, h, w = x.shape
    x = x.view(b, c, t // rt, rt, h // 2, 2, w // 2, 2).permute(0, 3, 5, 7, 1, 2, 4, 6)
    return x.reshape(b, rt * 4 * c, t // rt, h // 2, w // 2)


def unfold(x: Tensor, rt: int) -> Tensor:
    """The inverse of `fold`: (B, rt*2*2*C, T, H, W) -> (B, C, rt T, 2H, 2W)."""
    b, packed, t, h, w = x.shape
    c = packed // (rt * 4)
    x = x.view(b, rt, 2, 2, c, t, h, w).permute(0, 4, 5, 1, 6, 2, 7, 3)
    return x.reshape(b, c, t * rt, h * 2, w * 2)


def group_mean(x: Tensor, channels: int) -> Tensor:
    """(B, channels * g, ...) -> (B, channels, ...): the mean of each run of g channels."""
    b, c, *rest = x.shape
    return x.view(b, channels, c // channels, *rest).mean(dim=2)


class Downsample(nn.Module):
    """2x in H and W (and in time with `temporal`): conv to out / factor channels, fold."""

    def __init__(self, in_channels: int, out_channels: int, temporal: bool) -> None:
        super().__init__()
        self.temporal = temporal
        self.conv = CausalConv3d(in_channels, out_channels // (8 if temporal else 4))

    def forward(self, x: Tensor) -> Tensor:                            # (B, Cin, T, H, W)
        h = self.conv(x)
        if not self.temporal:
            h = fold(h, 1)                                             # (B, Cout, T, H/2, W/2)
            return h + group_mean(fold(x, 1), h.shape[1])
        first = fold(h[:, :, :1], 1)                                   # (B, Cout/2, 1, ..)
        h = torch.cat([torch.cat([first, first], dim=1), fold(h[:, :, 1:], 2)], dim=2)
        out = h.shape[1]                                               # (B, Cout, 1 + k, ..)
        shortcut = torch.cat([group_mean(fold(x[:, :, :1], 1), out),
                              group_mean(fold(x[:, :, 1:], 2), out)], dim=2)
        return h + shortcut


class Upsample(nn.Module):
    """2x in H and W (and in time with `temporal`): conv to out * factor channels, unfold."""

    def __init__(self, in_channels: int, out_channels: int, temporal: bool) -> None:
        super().__init__()
        self.temporal = temporal
        factor = 8 if temporal else 4
        self.conv = CausalConv3d(in_channels, out_channels * factor)
        self.repeats = factor * out_channels // in_channels

    def forward(self, x: Tensor) -> Tensor:                            # (B, Cin, T, H, W)
        h = self.conv(x)
        if not self.temporal:
            return unfold(h, 1) + unfold(x.repeat_interleave(self.repeats, dim=1), 1)
        first = unfold(h[:, :, :1], 1)                                 # (B, 2 Cout, 1, 2H, 2W)
        h = torch.cat([first[:, :first.shape[1] // 2], unfold(h[:, :, 1:], 2)], dim=2)
        shortcut = torch.cat(
            [unfold(x[:, :, :1], 1).repeat_interleave(self.repeats // 2, dim=1),
             unfold(x[:, :, 1:], 2).repeat_interleave(self.repeats, dim=1)], dim=2)
        return h + shortcut                                            # (B, Cout, 1 + 2(T-1), ..)


class DownBlock3D(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, num_layers: int,
                 down_channels: int | None, temporal: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(in_channels if i == 0 else out_channels,
                                                 out_channels) for i in range(num_layers))
        self.downsamplers = (nn.ModuleList([Downsample(out_channels, down_channels, temporal)])
                             if down_channels is not None else None)

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return x if self.downsamplers is None else self.downsamplers[0](x)


class UpBlock3D(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, num_layers: int,
                 up_channels: int | None, temporal: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(in_channels if i == 0 else out_channels,
                                                 out_channels) for i in range(num_layers))
        self.upsamplers = (nn.ModuleList([Upsample(out_channels, up_channels, temporal)])
                           if up_channels is not None else None)

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return x if self.upsamplers is None else self.upsamplers[0](x)
