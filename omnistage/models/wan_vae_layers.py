"""The building blocks of Wan's causal 3-D VAE (diffusers' `autoencoder_kl_wan.py`), shared by
`AutoencoderKLWan` (Wan 2.1, Wan 2.2) and `AutoencoderKLQwenImage` (Wan 2.1's VAE, fine-tuned).

Module and parameter names follow diffusers, so a `vae/` folder loads by name; numerics follow
it op for op.

Causal time. Every temporal kernel looks only into the past: a 3x3x3 conv pads two zero frames
in front. Time runs in chunks, as in diffusers (encoder: frame 0, then 4 frames at a time;
decoder: one latent frame at a time), and a `CausalCache` hands each conv the last two input
frames of the previous chunk, so chunked = the causal conv over the whole sequence:

    chunk k input:          | f_4k-3 .. f_4k |
    conv sees:    | cached 2 frames | f_4k-3 .. f_4k |    (zeros in place of frames before 0)

The temporal resamplers treat the first chunk apart: frame 0 is neither doubled (decoder) nor
merged (encoder); every later chunk goes through their time conv. Wan 2.2's residual stages
add a parameter-free shortcut around each resampling stage (`avg_down` / `dup_up`), which
treats the first chunk the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CACHE_T = 2             # frames of the previous chunk a temporal kernel of 3 needs


@dataclass(slots=True)
class CausalCache:
    """State carried between the time chunks of one encode or decode call.

    frames: per causal conv (the module itself is the key), the last CACHE_T frames of its
    input in the previous chunks; missing before the conv has seen any. Nothing is stored on
    the last chunk, so a one-frame image keeps no copies of its activations."""

    is_first: bool
    is_last: bool
    frames: dict[nn.Module, Tensor] = field(default_factory=dict)

    def next_chunk(self, is_last: bool) -> None:
        self.is_first, self.is_last = False, is_last


class CausalConv3d(nn.Conv3d):
    """Conv3d padded causally in time: 2 * pad_t frames in front (zeros, or the previous
    chunk's frames), symmetric padding in space."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int | tuple[int, int, int],
                 stride: int | tuple[int, int, int] = 1,
                 padding: int | tuple[int, int, int] = 0) -> None:
        super().__init__(in_ch, out_ch, kernel, stride=stride, padding=padding)
        pad_t, pad_h, pad_w = self.padding
        self.pad_front = 2 * pad_t
        self.pad_space = (pad_w, pad_w, pad_h, pad_h)
        self.padding = (0, 0, 0)

    def forward(self, x: Tensor, prev: Tensor | None = None) -> Tensor:
        """x (B, C, T, H, W), prev (B, C, <=2, H, W) frames before x -> (B, C', T', H', W')."""
        if prev is None and x.shape[2] == 1 and self.pad_front == self.kernel_size[0] - 1:
            # one frame after zeros: only the kernel's last time slice meets data. A 2-D conv
            # gives the same sums without the multiplications by zero (3x fewer for k_t = 3).
            out = F.conv2d(x[:, :, 0], self.weight[:, :, -1], self.bias, self.stride[1:],
                           padding=(self.pad_space[2], self.pad_space[0]))
            return out.unsqueeze(2)                                   # (B, C', 1, H', W')
        front = self.pad_front
        if prev is not None and front > 0:
            x = torch.cat([prev.to(x.device), x], dim=2)
            front -= prev.shape[2]
        return super().forward(F.pad(x, (*self.pad_space, front, 0)))


def causal_conv(conv: CausalConv3d, x: Tensor, cache: CausalCache) -> Tensor:
    """`conv(x)` continuing the previous chunks; remembers x's last frames for the next one."""
    prev = cache.frames.get(conv)
    if not cache.is_last:
        keep = x[:, :, -CACHE_T:].clone()
        if keep.shape[2] < CACHE_T and prev is not None:
            keep = torch.cat([prev[:, :, -1:].to(keep.device), keep], dim=2)
        cache.frames[conv] = keep
    return conv(x, prev)


class RMSNorm(nn.Module):
    """diffusers' WanRMS_norm: L2-normalize over channels (dim 1), times sqrt(C) * gamma.
    gamma is (C, 1, 1, 1) for 5-D inputs and (C, 1, 1) for per-frame 4-D ones."""

    def __init__(self, dim: int, images: bool = False) -> None:
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim, *(1,) * (2 if images else 3)))

    def forward(self, x: Tensor) -> Tensor:
        upcast = x.dtype in (torch.float16, torch.bfloat16)
        normed = F.normalize(x.float() if upcast else x, dim=1).to(x.dtype)
        return normed * self.scale * self.gamma


class ResidualBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(in_dim)
        self.conv1 = CausalConv3d(in_dim, out_dim, 3, padding=1)
        self.norm2 = RMSNorm(out_dim)
        self.conv2 = CausalConv3d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else None

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:     # (B, in, T, H, W)
        h = x if self.conv_shortcut is None else self.conv_shortcut(x)
        x = causal_conv(self.conv1, F.silu(self.norm1(x)), cache)
        x = causal_conv(self.conv2, F.silu(self.norm2(x)), cache)
        return x + h                                                # (B, out, T, H, W)


class AttentionBlock(nn.Module):
    """Single-head spatial self-attention within each frame, with a residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: Tensor) -> Tensor:                         # (B, C, T, H, W)
        b, c, t, h, w = x.shape
        frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)   # (BT, C, H, W)
        qkv = self.to_qkv(self.norm(frames)).reshape(b * t, 1, c * 3, h * w)
        q, k, v = qkv.permute(0, 1, 3, 2).contiguous().chunk(3, dim=-1)   # (BT, 1, HW, C)
        out = F.scaled_dot_product_attention(q, k, v)
        out = self.proj(out.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w))
        return out.view(b, t, c, h, w).permute(0, 2, 1, 3, 4) + x   # (B, C, T, H, W)


class Upsample(nn.Module):
    """Nearest-exact 2x in space, computed in float32 (diffusers' WanUpsample)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.interpolate(x.float(), scale_factor=(2.0, 2.0), mode="nearest-exact").type_as(x)


class Resample(nn.Module):
    """2x up or down in space, per frame; the `3d` modes also double (up) or halve (down) time
    through `time_conv`, from the second chunk on. Upsampling halves the channels (Wan 2.1)
    unless `up_dim` says otherwise (Wan 2.2's residual stages keep them)."""

    def __init__(self, dim: int, mode: str, up_dim: int | None = None) -> None:
        super().__init__()
        self.mode = mode
        if mode.startswith("upsample"):
            self.resample = nn.Sequential(Upsample(), nn.Conv2d(dim, up_dim or dim // 2, 3,
                                                                padding=1))
        else:
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)),
                                          nn.Conv2d(dim, dim, 3, stride=(2, 2)))
        if mode == "upsample3d":   # one frame in, two out: channels [first | second]
            self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        elif mode == "downsample3d":
            self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        if self.mode == "upsample3d" and not cache.is_first:
            b, c, t, h, w = x.shape
            x = causal_conv(self.time_conv, x, cache)                 # (B, 2C, T, H, W)
            x = x.reshape(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)
        b, c, t, h, w = x.shape
        x = self.resample(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        x = x.view(b, t, *x.shape[1:]).permute(0, 2, 1, 3, 4)         # (B, C', T, H', W')
        if self.mode == "downsample3d":
            prev = cache.frames.get(self.time_conv)
            if not cache.is_last:
                cache.frames[self.time_conv] = x[:, :, -1:].clone()
            if not cache.is_first:   # stride 2 over [last frame of before, this chunk]
                x = self.time_conv(torch.cat([prev[:, :, -1:], x], dim=2))
        return x


class MidBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attentions = nn.ModuleList([AttentionBlock(dim)])
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        x = self.resnets[0](x, cache)
        for attn, resnet in zip(self.attentions, self.resnets[1:]):
            x = resnet(attn(x), cache)
        return x


class UpBlock(nn.Module):
    """Wan 2.1's decoder stage: resnets, then an upsampler that halves the channels."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, mode: str | None) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(in_dim if i == 0 else out_dim, out_dim)
                                      for i in range(num_res_blocks + 1)])
        self.upsamplers = nn.ModuleList([Resample(out_dim, mode)] if mode else [])

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        for layer in [*self.resnets, *self.upsamplers]:
            x = layer(x, cache)
        return x


# ---- Wan 2.2's residual resampling stages ------------------------------------------------

def _check_groups(from_dim: int, to_dim: int, factor: int, what: str) -> None:
    """The shortcut's channels x positions must split evenly into the other side's channels."""
    if (from_dim * factor) % to_dim:
        raise ValueError(f"{what}: {from_dim} channels x {factor} positions do not split "
                         f"evenly into {to_dim} channels (check base_dim and dim_mult)")


def avg_down(x: Tensor, out_dim: int, factor_t: int, factor_s: int) -> Tensor:
    """diffusers' AvgDown3D: each (factor_t, factor_s, factor_s) block of positions becomes
    channels, and groups of those channels are averaged down to `out_dim`. Time is padded
    in front with zeros to a multiple of factor_t (the one-frame first chunk: mean of 0, f0).

    x (B, C, T, H, W) -> (B, out_dim, T / ft, H / fs, W / fs)"""
    x = F.pad(x, (0, 0, 0, 0, (factor_t - x.shape[2] % factor_t) % factor_t, 0))
    b, c, t, h, w = x.shape
    t, h, w = t // factor_t, h // factor_s, w // factor_s
    x = x.view(b, c, t, factor_t, h, factor_s, w, factor_s).permute(0, 1, 3, 5, 7, 2, 4, 6)
    group = c * factor_t * factor_s * factor_s // out_dim
    return x.contiguous().view(b, out_dim, group, t, h, w).mean(dim=2)


def dup_up(x: Tensor, out_dim: int, factor_t: int, factor_s: int, is_first: bool) -> Tensor:
    """diffusers' DupUp3D: channels repeated, then spread over (factor_t, factor_s, factor_s)
    blocks of positions; on the first chunk only the last factor_t copy of frame 0 is kept,
    as the upsampler keeps frame 0 single.

    x (B, C, T, H, W) -> (B, out_dim, T * ft (first chunk: T * ft - ft + 1), H * fs, W * fs)"""
    b, c, t, h, w = x.shape
    x = x.repeat_interleave(out_dim * factor_t * factor_s * factor_s // c, dim=1)
    x = x.view(b, out_dim, factor_t, factor_s, factor_s, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    x = x.reshape(b, out_dim, t * factor_t, h * factor_s, w * factor_s)
    return x[:, :, factor_t - 1:] if is_first else x


class ResidualDownBlock(nn.Module):
    """Wan 2.2's encoder stage: resnets then a downsampler, plus `avg_down` of the input."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool,
                 down: bool) -> None:
        super().__init__()
        self.factor_t, self.factor_s, self.out_dim = 1 + temporal, 1 + down, out_dim
        _check_groups(in_dim, out_dim, self.factor_t * self.factor_s ** 2, "avg_down shortcut")
        self.resnets = nn.ModuleList([ResidualBlock(in_dim if i == 0 else out_dim, out_dim)
                                      for i in range(num_res_blocks)])
        mode = "downsample3d" if temporal else "downsample2d"
        self.downsampler = Resample(out_dim, mode) if down else None

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:     # (B, in, T, H, W)
        shortcut = avg_down(x, self.out_dim, self.factor_t, self.factor_s)
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.downsampler is not None:
            x = self.downsampler(x, cache)
        return x + shortcut                                         # (B, out, T', H', W')


class ResidualUpBlock(nn.Module):
    """Wan 2.2's decoder stage: resnets then an upsampler keeping the channels, plus `dup_up`
    of the input."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool,
                 up: bool) -> None:
        super().__init__()
        self.factor_t, self.out_dim = 1 + temporal, out_dim
        if up:
            _check_groups(out_dim, in_dim, self.factor_t * 4, "dup_up shortcut")
        self.resnets = nn.ModuleList([ResidualBlock(in_dim if i == 0 else out_dim, out_dim)
                                      for i in range(num_res_blocks + 1)])
        mode = "upsample3d" if temporal else "upsample2d"
        self.upsampler = Resample(out_dim, mode, up_dim=out_dim) if up else None

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:     # (B, in, T, H, W)
        shortcut = None
        if self.upsampler is not None:
            shortcut = dup_up(x, self.out_dim, self.factor_t, 2, cache.is_first)
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.upsampler is None:
            return x
        return self.upsampler(x, cache) + shortcut                  # (B, out, T', H', W')
