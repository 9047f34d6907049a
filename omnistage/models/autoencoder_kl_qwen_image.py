"""The Qwen-Image VAE: diffusers' `AutoencoderKLQwenImage` (the causal 3-D VAE of Wan 2.1,
fine-tuned) in plain PyTorch.

Module and parameter names follow diffusers, so a pipeline's `vae/` folder loads by name
(`AutoencoderKLQwenImage.from_pretrained`); numerics follow
`diffusers/models/autoencoders/autoencoder_kl_qwenimage.py` op for op.

    videos (B,3,T,H,W) in [-1,1] -> Encoder3d -> quant_conv -> (B,2C,T',h,w) = [mean | logvar]
    latents (B,C,T',h,w) -> post_quant_conv -> Decoder3d -> clamp(-1,1) -> (B,3,T,H,W)

h = H / 2**len(temperal_downsample) (8 for Qwen-Image), T = 1 + 4 (T' - 1) with two temporal
halvings. An image is a one-frame video: T = T' = 1, which is all a text-to-image pipeline uses.
`encode` / `decode` work on raw latents; the diffusion space is `(z - mean) / std` per channel
with the config's `latents_mean` / `latents_std` (`normalize` / `denormalize`).

Causal time. Every temporal kernel looks only into the past: a 3x3x3 conv pads two zero frames
in front. Time runs in chunks, as in diffusers (encoder: frame 0, then 4 frames at a time;
decoder: one latent frame at a time), and a `CausalCache` hands each conv the last two input
frames of the previous chunk, so chunked = the causal conv over the whole sequence:

    chunk k input:          | f_4k-3 .. f_4k |
    conv sees:    | cached 2 frames | f_4k-3 .. f_4k |    (zeros in place of frames before 0)

The temporal resamplers treat the first chunk apart: frame 0 is neither doubled (decoder) nor
merged (encoder); every later chunk goes through their time conv.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.diffusers_loader import (build_from_folder, config_from_dict,
                                               read_config)

CACHE_T = 2             # frames of the previous chunk a temporal kernel of 3 needs
ENCODE_CHUNK = 4        # frames per encoder chunk after the first (two temporal halvings)


@dataclass(frozen=True, slots=True)
class AutoencoderKLQwenImageConfig:
    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)   # diffusers' spelling
    dropout: float = 0.0                                          # inference: unused
    input_channels: int = 3
    # per-channel statistics of Qwen-Image's latents (diffusers' defaults)
    latents_mean: tuple[float, ...] = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653,
                                       -0.1517, 1.5508, 0.4134, -0.0715, 0.5517, -0.3632,
                                       -0.1922, -0.9497, 0.2503, -0.2921)
    latents_std: tuple[float, ...] = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052,
                                      2.0743, 3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253,
                                      2.8251, 1.9160)

    def __post_init__(self) -> None:
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(f"temperal_downsample {self.temperal_downsample}: needs "
                             f"len(dim_mult) - 1 = {len(self.dim_mult) - 1} entries")
        if self.attn_scales:   # diffusers' encoder fails on these blocks (no cache argument)
            raise ValueError(f"attn_scales {self.attn_scales}: only [] is supported (Qwen-Image's)")
        for key in ("latents_mean", "latents_std"):
            if len(getattr(self, key)) != self.z_dim:
                raise ValueError(f"{key}: {len(getattr(self, key))} values for z_dim={self.z_dim}")

    @property
    def downscale(self) -> int:
        """Pixels per latent along H and W (diffusers' `spatial_compression_ratio`)."""
        return 2 ** len(self.temperal_downsample)

    @classmethod
    def from_dict(cls, raw: dict) -> AutoencoderKLQwenImageConfig:
        return config_from_dict(cls, raw, "AutoencoderKLQwenImage")


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


# ---- layers --------------------------------------------------------------------------------

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
    """diffusers' QwenImageRMS_norm: L2-normalize over channels (dim 1), times sqrt(C) * gamma.
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
    """Nearest-exact 2x in space, computed in float32 (diffusers' QwenImageUpsample)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.interpolate(x.float(), scale_factor=(2.0, 2.0), mode="nearest-exact").type_as(x)


class Resample(nn.Module):
    """2x up or down in space, per frame; the `3d` modes also double (up) or halve (down) time
    through `time_conv`, from the second chunk on."""

    def __init__(self, dim: int, mode: str) -> None:
        super().__init__()
        self.mode = mode
        if mode.startswith("upsample"):
            self.resample = nn.Sequential(Upsample(), nn.Conv2d(dim, dim // 2, 3, padding=1))
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
    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, mode: str | None) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(in_dim if i == 0 else out_dim, out_dim)
                                      for i in range(num_res_blocks + 1)])
        self.upsamplers = nn.ModuleList([Resample(out_dim, mode)] if mode else [])

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:
        for layer in [*self.resnets, *self.upsamplers]:
            x = layer(x, cache)
        return x


class Encoder3d(nn.Module):
    def __init__(self, cfg: AutoencoderKLQwenImageConfig) -> None:
        super().__init__()
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        self.conv_in = CausalConv3d(cfg.input_channels, dims[0], 3, padding=1)
        blocks: list[nn.Module] = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim))
                in_dim = out_dim
            if i < len(cfg.dim_mult) - 1:
                temporal = cfg.temperal_downsample[i]
                blocks.append(Resample(out_dim, "downsample3d" if temporal else "downsample2d"))
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], 2 * cfg.z_dim, 3, padding=1)

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:     # (B, 3, T, H, W)
        x = causal_conv(self.conv_in, x, cache)
        for block in self.down_blocks:
            x = block(x, cache)
        x = self.mid_block(x, cache)                                # (B, C_top, T', h, w)
        return causal_conv(self.conv_out, F.silu(self.norm_out(x)), cache)   # (B, 2z, T', h, w)


class Decoder3d(nn.Module):
    def __init__(self, cfg: AutoencoderKLQwenImageConfig) -> None:
        super().__init__()
        mults = cfg.dim_mult
        dims = [cfg.base_dim * m for m in (mults[-1], *mults[::-1])]
        temporal = cfg.temperal_downsample[::-1]
        self.conv_in = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        blocks = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if i > 0:
                in_dim //= 2                        # the upsampler before halved the channels
            mode = None
            if i < len(mults) - 1:
                mode = "upsample3d" if temporal[i] else "upsample2d"
            blocks.append(UpBlock(in_dim, out_dim, cfg.num_res_blocks, mode))
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], cfg.input_channels, 3, padding=1)

    def forward(self, z: Tensor, cache: CausalCache) -> Tensor:     # (B, z, T', h, w)
        x = self.mid_block(causal_conv(self.conv_in, z, cache), cache)
        for block in self.up_blocks:
            x = block(x, cache)
        return causal_conv(self.conv_out, F.silu(self.norm_out(x)), cache)   # (B, 3, T, H, W)


# ---- model ---------------------------------------------------------------------------------

class AutoencoderKLQwenImage(nn.Module):
    def __init__(self, cfg: AutoencoderKLQwenImageConfig) -> None:
        super().__init__()
        self.cfg = cfg
        z = cfg.z_dim
        self.encoder = Encoder3d(cfg)
        self.quant_conv = CausalConv3d(2 * z, 2 * z, 1)
        self.post_quant_conv = CausalConv3d(z, z, 1)
        self.decoder = Decoder3d(cfg)

    # ---- encode ----

    def _encode_frames(self, videos: Tensor) -> Tensor:
        """videos (B, 3, T, H, W) -> [mean | logvar] (B, 2z, T', h, w), logvar unclamped."""
        num_frames = videos.shape[2]
        if (num_frames - 1) % ENCODE_CHUNK:
            raise ValueError(f"videos: {num_frames} frames; the encoder takes 1 + "
                             f"{ENCODE_CHUNK} k (frame 0, then chunks of {ENCODE_CHUNK})")
        bounds = [0, *range(1, num_frames + 1, ENCODE_CHUNK)]          # 0, 1, 5, 9, ..., T
        cache = CausalCache(is_first=True, is_last=num_frames == 1)
        chunks = []
        for k, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if k:
                cache.next_chunk(is_last=end == num_frames)
            chunks.append(self.encoder(videos[:, :, start:end], cache))
        return self.quant_conv(torch.cat(chunks, dim=2))

    def moments(self, videos: Tensor) -> tuple[Tensor, Tensor]:
        """videos (B, 3, T, H, W) in [-1, 1] -> posterior mean, logvar (B, z, T', h, w)."""
        _check_5d(videos, "videos")
        mean, logvar = self._encode_frames(videos).chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def encode(self, videos: Tensor) -> Tensor:
        """-> posterior mean (B, z, T', h, w), raw; `retrieve_latents(..., "argmax")`."""
        return self.moments(videos)[0]

    def sample_latents(self, videos: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """A posterior draw mean + std * eps, `retrieve_latents(..., generator)`: eps drawn like
        diffusers' `randn_tensor` on the generator's device, in the latents' dtype."""
        mean, logvar = self.moments(videos)
        gen_device = generator.device if generator is not None else mean.device
        eps = torch.randn(mean.shape, generator=generator, device=gen_device, dtype=mean.dtype)
        return mean + torch.exp(0.5 * logvar) * eps.to(mean.device)

    # ---- decode ----

    def _decode_frames(self, latents: Tensor) -> Tensor:
        """Unclamped: what one (tile of a) decode produces before diffusers' clamp."""
        x = self.post_quant_conv(latents)                           # (B, z, T', h, w)
        num_frames = x.shape[2]
        cache = CausalCache(is_first=True, is_last=num_frames == 1)
        out = []
        for i in range(num_frames):
            if i:
                cache.next_chunk(is_last=i == num_frames - 1)
            out.append(self.decoder(x[:, :, i:i + 1], cache))
        return torch.cat(out, dim=2)                                # (B, 3, T, H, W)

    def decode(self, latents: Tensor) -> Tensor:
        """raw latents (B, z, T', h, w) -> videos (B, 3, T, H, W) clamped to [-1, 1]."""
        _check_5d(latents, "latents")
        return self._decode_frames(latents).clamp(-1.0, 1.0)

    # ---- tiling (diffusers' `enable_tiling()`, same tile sizes in pixels) ----

    def decode_tiled(self, latents: Tensor, tile: tuple[int, int] = (256, 256),
                     stride: tuple[int, int] = (192, 192)) -> Tensor:
        """`decode` in overlapping tiles, as diffusers with `enable_tiling(tile_sample_min_height,
        tile_sample_min_width, tile_sample_stride_height, tile_sample_stride_width)`: latent
        tiles of tile // 8 with stride // 8; decoded tiles blend over tile - stride pixels.
        Latents that fit in one tile decode untiled (and clamped); tiled output is not clamped,
        as in diffusers."""
        _check_5d(latents, "latents")
        r = self.cfg.downscale
        in_tile, in_stride = (tile[0] // r, tile[1] // r), (stride[0] // r, stride[1] // r)
        if latents.shape[3] <= in_tile[0] and latents.shape[4] <= in_tile[1]:
            return self.decode(latents)
        size = (latents.shape[3] * r, latents.shape[4] * r)
        return _tiled(self._decode_frames, latents, in_tile, in_stride,
                      blend=(tile[0] - stride[0], tile[1] - stride[1]), keep=stride, size=size)

    def encode_tiled(self, videos: Tensor, tile: tuple[int, int] = (256, 256),
                     stride: tuple[int, int] = (192, 192)) -> Tensor:
        """`encode` (the mean) in overlapping pixel tiles, as diffusers' `tiled_encode`; the
        latent tiles blend over (tile - stride) // 8 latents."""
        _check_5d(videos, "videos")
        if videos.shape[3] <= tile[0] and videos.shape[4] <= tile[1]:
            return self.encode(videos)
        r = self.cfg.downscale
        out_tile, out_stride = (tile[0] // r, tile[1] // r), (stride[0] // r, stride[1] // r)
        size = (videos.shape[3] // r, videos.shape[4] // r)
        moments = _tiled(self._encode_frames, videos, tile, stride,
                         blend=(out_tile[0] - out_stride[0], out_tile[1] - out_stride[1]),
                         keep=out_stride, size=size)                 # (B, 2z, T', h, w)
        return moments.chunk(2, dim=1)[0]

    # ---- diffusion space ----

    def _stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        """(mean, 1 / std) shaped (1, z, 1, 1, 1) in like's dtype; diffusers divides by 1 / std
        (not multiplies by std), and so do we, for the same rounding."""
        shape = (1, self.cfg.z_dim, 1, 1, 1)
        mean = torch.tensor(self.cfg.latents_mean).view(shape).to(like.device, like.dtype)
        inv_std = 1.0 / torch.tensor(self.cfg.latents_std).view(shape).to(like.device, like.dtype)
        return mean, inv_std

    def normalize(self, latents: Tensor) -> Tensor:      # raw -> the diffusion model's space
        mean, inv_std = self._stats(latents)
        return (latents - mean) * inv_std

    def denormalize(self, latents: Tensor) -> Tensor:
        mean, inv_std = self._stats(latents)
        return latents / inv_std + mean

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> AutoencoderKLQwenImage:
        """Build from a diffusers `vae/` folder in `dtype` (None: the checkpoint's). Missing,
        unexpected or mis-shaped tensors raise ValueError naming them."""
        path = Path(path)
        cfg = AutoencoderKLQwenImageConfig.from_dict(read_config(path))
        return build_from_folder(cls, cfg, path, device, dtype)


def _check_5d(x: Tensor, name: str) -> None:
    if x.dim() != 5:
        raise ValueError(f"{name}: expected (B, C, T, H, W) (an image is T = 1), got "
                         f"{tuple(x.shape)}")


def _tiled(fn: Callable[[Tensor], Tensor], x: Tensor, tile: tuple[int, int],
           stride: tuple[int, int], blend: tuple[int, int], keep: tuple[int, int],
           size: tuple[int, int]) -> Tensor:
    """fn over overlapping (tile, stride) windows of x's last two dims, each output blended
    with the one above and to the left over `blend`, cropped to `keep`, joined, cut to `size`.

        | keep | blend |                 (one output tile)
               | keep | blend |
    """
    rows = [[fn(x[..., i:i + tile[0], j:j + tile[1]]) for j in range(0, x.shape[-1], stride[1])]
            for i in range(0, x.shape[-2], stride[0])]
    joined = []
    for i, row in enumerate(rows):
        for j, t in enumerate(row):   # in place, so later tiles blend with blended ones
            if i > 0:
                _blend(rows[i - 1][j], t, blend[0], dim=-2)
            if j > 0:
                _blend(row[j - 1], t, blend[1], dim=-1)
        joined.append(torch.cat([t[..., :keep[0], :keep[1]] for t in row], dim=-1))
    return torch.cat(joined, dim=-2)[..., :size[0], :size[1]]


def _blend(a: Tensor, b: Tensor, extent: int, dim: int) -> None:
    """Blend the first `extent` rows (dim=-2) or columns (dim=-1) of `b` in place with the last
    ones of `a`; b's weight rises y / extent from 0 (diffusers' blend_v / blend_h, whose Python
    float weights these float64 ones round like)."""
    extent = min(a.shape[dim], b.shape[dim], extent)
    if extent <= 0:
        return
    w = torch.arange(extent, dtype=torch.float64, device=b.device) / extent
    w = w.view(-1, 1) if dim == -2 else w
    tail = a.narrow(dim, a.shape[dim] - extent, extent)
    head = b.narrow(dim, 0, extent)
    head.copy_(tail * (1 - w).to(b.dtype) + head * w.to(b.dtype))
