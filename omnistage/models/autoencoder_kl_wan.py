"""Wan's video VAE: diffusers' `AutoencoderKLWan` in plain PyTorch, for Wan 2.1 (z_dim 16,
4x in time, 8x in space) and Wan 2.2-TI2V-5B's high-compression VAE (z_dim 48, 16x in space:
a 2x2 patchify around an 8x network with residual resampling stages, `is_residual`).
`AutoencoderKLQwenImage` is this class under Qwen-Image's config keys.

    videos (B,3,T,H,W) in [-1,1] -> patchify(p) -> Encoder3d -> quant_conv -> [mean | logvar]
    latents (B,z,T',h,w) -> post_quant_conv -> Decoder3d -> unpatchify(p) -> clamp(-1,1)

h = H / (2**len(temperal_downsample) * p), T = 1 + 4 (T' - 1) with two temporal halvings.
An image is a one-frame video: T = T' = 1. `encode` / `decode` work on raw latents; the
diffusion space is `(z - mean) / std` per channel (`normalize` / `denormalize`). The layers and
the causal chunking are in `wan_vae_layers.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from itertools import pairwise
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.diffusers_loader import build_from_folder, read_config
from omnistage.models.wan_vae_layers import (CausalCache, CausalConv3d, MidBlock, Resample,
                                             ResidualBlock, ResidualDownBlock, ResidualUpBlock,
                                             RMSNorm, UpBlock, causal_conv)

ENCODE_CHUNK = 4        # frames per encoder chunk after the first (diffusers' fixed chunking)
# Wan 2.1's per-channel latent statistics (diffusers' defaults)
WAN21_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687,
                     2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)


@dataclass(frozen=True, slots=True)
class AutoencoderKLWanConfig:
    base_dim: int = 96
    decoder_base_dim: int | None = None                           # None: base_dim
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)   # diffusers' spelling
    dropout: float = 0.0                                          # inference: unused
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD
    is_residual: bool = False                                     # Wan 2.2's resampling stages
    in_channels: int = 3                                          # after patchify: 3 p^2
    out_channels: int = 3
    patch_size: int | None = None
    scale_factor_temporal: int | None = 4                         # stated; must match the net
    scale_factor_spatial: int | None = 8

    def __post_init__(self) -> None:
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(f"temperal_downsample {self.temperal_downsample}: needs "
                             f"len(dim_mult) - 1 = {len(self.dim_mult) - 1} entries")
        if self.attn_scales:   # diffusers' encoder fails on these blocks (no cache argument)
            raise ValueError(f"attn_scales {self.attn_scales}: only [] is supported")
        for key in ("latents_mean", "latents_std"):
            if len(getattr(self, key)) != self.z_dim:
                raise ValueError(f"{key}: {len(getattr(self, key))} values for z_dim={self.z_dim}")
        for key, have in (("scale_factor_spatial", self.downscale),
                          ("scale_factor_temporal", self.temporal_downscale)):
            stated = getattr(self, key)
            if stated is not None and stated != have:
                raise ValueError(f"{key}={stated}, but the network (dim_mult, "
                                 f"temperal_downsample, patch_size) gives {have}")
        for key in ("in_channels", "out_channels"):
            if getattr(self, key) % self.patch ** 2:
                raise ValueError(f"{key}={getattr(self, key)}: not a multiple of "
                                 f"patch_size**2 = {self.patch ** 2}")

    @property
    def patch(self) -> int:
        return self.patch_size or 1

    @property
    def downscale(self) -> int:
        """Pixels per latent along H and W (diffusers' `spatial_compression_ratio`)."""
        return 2 ** len(self.temperal_downsample) * self.patch

    @property
    def temporal_downscale(self) -> int:
        """Frames per latent frame after the first."""
        return 2 ** sum(self.temperal_downsample)

    @classmethod
    def from_dict(cls, raw: dict) -> AutoencoderKLWanConfig:
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"AutoencoderKLWan config: unknown keys {unknown}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


class Encoder3d(nn.Module):
    def __init__(self, cfg: AutoencoderKLWanConfig) -> None:
        super().__init__()
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        self.conv_in = CausalConv3d(cfg.in_channels, dims[0], 3, padding=1)
        blocks: list[nn.Module] = []
        for i, (in_dim, out_dim) in enumerate(pairwise(dims)):
            down = i < len(cfg.dim_mult) - 1
            temporal = down and cfg.temperal_downsample[i]
            if cfg.is_residual:
                blocks.append(ResidualDownBlock(in_dim, out_dim, cfg.num_res_blocks, temporal,
                                                down))
                continue
            blocks += [ResidualBlock(in_dim if j == 0 else out_dim, out_dim)
                       for j in range(cfg.num_res_blocks)]
            if down:
                blocks.append(Resample(out_dim, "downsample3d" if temporal else "downsample2d"))
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], 2 * cfg.z_dim, 3, padding=1)

    def forward(self, x: Tensor, cache: CausalCache) -> Tensor:     # (B, 3p^2, T, H/p, W/p)
        x = causal_conv(self.conv_in, x, cache)
        for block in self.down_blocks:
            x = block(x, cache)
        x = self.mid_block(x, cache)                                # (B, C_top, T', h, w)
        return causal_conv(self.conv_out, F.silu(self.norm_out(x)), cache)   # (B, 2z, T', h, w)


class Decoder3d(nn.Module):
    def __init__(self, cfg: AutoencoderKLWanConfig) -> None:
        super().__init__()
        mults = cfg.dim_mult
        dims = [(cfg.decoder_base_dim or cfg.base_dim) * m for m in (mults[-1], *mults[::-1])]
        temporal = cfg.temperal_downsample[::-1]
        self.conv_in = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        blocks: list[nn.Module] = []
        for i, (in_dim, out_dim) in enumerate(pairwise(dims)):
            up = i < len(mults) - 1
            if cfg.is_residual:
                blocks.append(ResidualUpBlock(in_dim, out_dim, cfg.num_res_blocks,
                                              up and temporal[i], up))
                continue
            if i > 0:
                in_dim //= 2                        # the upsampler before halved the channels
            mode = ("upsample3d" if temporal[i] else "upsample2d") if up else None
            blocks.append(UpBlock(in_dim, out_dim, cfg.num_res_blocks, mode))
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], cfg.out_channels, 3, padding=1)

    def forward(self, z: Tensor, cache: CausalCache) -> Tensor:     # (B, z, T', h, w)
        x = self.mid_block(causal_conv(self.conv_in, z, cache), cache)
        for block in self.up_blocks:
            x = block(x, cache)
        return causal_conv(self.conv_out, F.silu(self.norm_out(x)), cache)  # (B, 3p^2, T, ..)


def patchify(x: Tensor, p: int) -> Tensor:
    """(B, C, T, H, W) -> (B, C p p, T, H/p, W/p), channel order (c, pw, ph) as diffusers."""
    if p == 1:
        return x
    b, c, t, h, w = x.shape
    x = x.view(b, c, t, h // p, p, w // p, p).permute(0, 1, 6, 4, 2, 3, 5)
    return x.reshape(b, c * p * p, t, h // p, w // p)


def unpatchify(x: Tensor, p: int) -> Tensor:
    """The inverse of `patchify`."""
    if p == 1:
        return x
    b, cpp, t, h, w = x.shape
    x = x.view(b, cpp // (p * p), p, p, t, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, cpp // (p * p), t, h * p, w * p)


class AutoencoderKLWan(nn.Module):
    """Encode videos to raw latents and back; `from_pretrained` loads a diffusers `vae/`."""

    clamp_tiled = True      # diffusers' Wan clamps a tiled decode; its Qwen-Image VAE does not

    def __init__(self, cfg: AutoencoderKLWanConfig) -> None:
        super().__init__()
        self.cfg = cfg
        z = cfg.z_dim
        self.encoder = Encoder3d(cfg)
        self.quant_conv = CausalConv3d(2 * z, 2 * z, 1)
        self.post_quant_conv = CausalConv3d(z, z, 1)
        self.decoder = Decoder3d(cfg)

    # ---- encode ----

    def _encode_frames(self, x: Tensor) -> Tensor:
        """patchified videos (B, 3p^2, T, H/p, W/p) -> [mean | logvar] (B, 2z, T', h, w),
        logvar unclamped: frame 0 alone, then chunks of ENCODE_CHUNK frames."""
        num_frames = x.shape[2]
        bounds = [0, *range(1, num_frames + 1, ENCODE_CHUNK)]          # 0, 1, 5, 9, ..., T
        cache = CausalCache(is_first=True, is_last=num_frames == 1)
        chunks = []
        for k, (start, end) in enumerate(pairwise(bounds)):
            if k:
                cache.next_chunk(is_last=end == num_frames)
            chunks.append(self.encoder(x[:, :, start:end], cache))
        return self.quant_conv(torch.cat(chunks, dim=2))

    def _check_videos(self, videos: Tensor) -> None:
        _check_5d(videos, "videos")
        channels = self.cfg.in_channels // self.cfg.patch ** 2
        r = self.cfg.downscale
        num_frames, height, width = videos.shape[2:]
        if videos.shape[1] != channels:
            raise ValueError(f"videos: {videos.shape[1]} channels, the VAE takes {channels}")
        if (num_frames - 1) % ENCODE_CHUNK:
            raise ValueError(f"videos: {num_frames} frames; the encoder takes 1 + "
                             f"{ENCODE_CHUNK} k (frame 0, then chunks of {ENCODE_CHUNK})")
        if height % r or width % r:
            raise ValueError(f"videos: {height}x{width} pixels; height and width must be "
                             f"multiples of the VAE's spatial factor {r}")

    def moments(self, videos: Tensor) -> tuple[Tensor, Tensor]:
        """videos (B, 3, T, H, W) in [-1, 1] -> posterior mean, logvar (B, z, T', h, w)."""
        self._check_videos(videos)
        moments = self._encode_frames(patchify(videos, self.cfg.patch))
        mean, logvar = moments.chunk(2, dim=1)
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
        """Patchified and unclamped: what one (tile of a) decode gives before unpatchify."""
        x = self.post_quant_conv(latents)                           # (B, z, T', h, w)
        num_frames = x.shape[2]
        cache = CausalCache(is_first=True, is_last=num_frames == 1)
        out = []
        for i in range(num_frames):
            if i:
                cache.next_chunk(is_last=i == num_frames - 1)
            out.append(self.decoder(x[:, :, i:i + 1], cache))
        return torch.cat(out, dim=2)                                # (B, 3p^2, T, H/p, W/p)

    def _check_latents(self, latents: Tensor) -> None:
        _check_5d(latents, "latents")
        if latents.shape[1] != self.cfg.z_dim:
            raise ValueError(f"latents: {latents.shape[1]} channels, the VAE has "
                             f"z_dim={self.cfg.z_dim}")

    def decode(self, latents: Tensor) -> Tensor:
        """raw latents (B, z, T', h, w) -> videos (B, 3, T, H, W) clamped to [-1, 1],
        T = 1 + temporal_downscale (T' - 1)."""
        self._check_latents(latents)
        return unpatchify(self._decode_frames(latents), self.cfg.patch).clamp(-1.0, 1.0)

    # ---- tiling (diffusers' `enable_tiling()`, same tile sizes in pixels) ----

    def decode_tiled(self, latents: Tensor, tile: tuple[int, int] = (256, 256),
                     stride: tuple[int, int] = (192, 192)) -> Tensor:
        """`decode` in overlapping tiles, as diffusers with `enable_tiling(tile_sample_min_height,
        tile_sample_min_width, tile_sample_stride_height, tile_sample_stride_width)`: latent
        tiles of tile // r with stride // r (r = `downscale`); decoded tiles blend over
        (tile - stride) / p pixels before unpatchify. Latents that fit in one tile decode
        untiled."""
        self._check_latents(latents)
        r, p = self.cfg.downscale, self.cfg.patch
        in_tile, in_stride = (tile[0] // r, tile[1] // r), (stride[0] // r, stride[1] // r)
        if latents.shape[3] <= in_tile[0] and latents.shape[4] <= in_tile[1]:
            return self.decode(latents)
        keep = (stride[0] // p, stride[1] // p)
        out = _tiled(self._decode_frames, latents, in_tile, in_stride,
                     blend=(tile[0] // p - keep[0], tile[1] // p - keep[1]), keep=keep,
                     size=(latents.shape[3] * r // p, latents.shape[4] * r // p))
        out = unpatchify(out, p)
        return out.clamp(-1.0, 1.0) if self.clamp_tiled else out

    def encode_tiled(self, videos: Tensor, tile: tuple[int, int] = (256, 256),
                     stride: tuple[int, int] = (192, 192)) -> Tensor:
        """`encode` (the mean) in overlapping tiles, as diffusers' `tiled_encode`: tiles of
        `tile` patchified pixels (diffusers' sizes, applied after patchify); the latent tiles
        blend over (tile - stride) // (r / p) latents."""
        self._check_videos(videos)
        if videos.shape[3] <= tile[0] and videos.shape[4] <= tile[1]:
            return self.encode(videos)
        e = self.cfg.downscale // self.cfg.patch            # latents per patchified pixel
        x = patchify(videos, self.cfg.patch)
        keep = (stride[0] // e, stride[1] // e)
        moments = _tiled(self._encode_frames, x, tile, stride,
                         blend=(tile[0] // e - keep[0], tile[1] // e - keep[1]), keep=keep,
                         size=(x.shape[3] // e, x.shape[4] // e))   # (B, 2z, T', h, w)
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
    def config_from_dict(cls, raw: dict) -> AutoencoderKLWanConfig:
        return AutoencoderKLWanConfig.from_dict(raw)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> AutoencoderKLWan:
        """Build from a diffusers `vae/` folder in `dtype` (None: the checkpoint's). Missing,
        unexpected or mis-shaped tensors raise ValueError naming them."""
        path = Path(path)
        return build_from_folder(cls, cls.config_from_dict(read_config(path)), path, device,
                                 dtype)


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
