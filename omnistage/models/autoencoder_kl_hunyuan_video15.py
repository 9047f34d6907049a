"""HunyuanVideo-1.5's video VAE: diffusers' `AutoencoderKLHunyuanVideo15` in plain PyTorch
(32 latent channels, 16x in space, 4x in time, published `block_out_channels` 128 .. 1024).

    videos (B,3,T,H,W) in [-1,1] -> Encoder3D -> [mean | logvar] (B,2z,T',H/r,W/r)
    latents (B,z,T',h,w) -> Decoder3D -> videos (B,3,1+t(T'-1),r h,r w), not clamped

r = spatial_compression_ratio, t = temporal_compression_ratio; the encoder takes T = 1 + t k
frames (an image is T = 1) and H, W multiples of r. The diffusion model's space is the
posterior mean times `scaling_factor` (`normalize`; `denormalize` divides, as the pipelines
do before decoding). The blocks are in `hunyuan_video15_vae_layers.py`.

Down blocks i < log2(r) halve H and W, and also T when i >= log2(r / t); up block i doubles H
and W when i < log2(r), and T when i < log2(t). Both ends have a parameter-free shortcut:
the encoder adds the channel-group mean of its last features to its output, the decoder the
latents repeated over channels to its first convolution's output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from omnistage.models.autoencoder_kl_wan import _tiled
from omnistage.models.diffusers_loader import build_from_folder, config_from_dict, read_config
from omnistage.models.hunyuan_video15_vae_layers import (CausalConv3d, DownBlock3D, MidBlock,
                                                         RMSNorm, UpBlock3D, group_mean)

TILE = 256               # diffusers' `tile_sample_min_height` / `_width` after `enable_tiling()`
TILE_OVERLAP = 0.25      # diffusers' `tile_overlap_factor`


@dataclass(frozen=True, slots=True)
class AutoencoderKLHunyuanVideo15Config:
    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 32
    block_out_channels: tuple[int, ...] = (128, 256, 512, 1024, 1024)
    layers_per_block: int = 2
    spatial_compression_ratio: int = 16
    temporal_compression_ratio: int = 4
    downsample_match_channel: bool = True
    upsample_match_channel: bool = True
    scaling_factor: float = 1.03682

    def __post_init__(self) -> None:
        r, t = self.spatial_compression_ratio, self.temporal_compression_ratio
        for key, value in (("spatial_compression_ratio", r), ("temporal_compression_ratio", t)):
            if value < 1 or value & (value - 1):
                raise ValueError(f"{key}={value}: must be a power of two")
        if t > r:
            raise ValueError(f"temporal_compression_ratio={t}: at most "
                             f"spatial_compression_ratio={r} (time halves with space)")
        if len(self.block_out_channels) <= self.num_spatial:
            raise ValueError(f"block_out_channels {self.block_out_channels}: needs more than "
                             f"log2(spatial_compression_ratio) = {self.num_spatial} entries")

    @property
    def num_spatial(self) -> int:
        return int(math.log2(self.spatial_compression_ratio))

    @property
    def num_temporal(self) -> int:
        return int(math.log2(self.temporal_compression_ratio))

    @property
    def downscale(self) -> int:
        """Pixels per latent along H and W."""
        return self.spatial_compression_ratio

    @property
    def temporal_downscale(self) -> int:
        """Frames per latent frame after the first."""
        return self.temporal_compression_ratio


class Encoder3D(nn.Module):
    def __init__(self, cfg: AutoencoderKLHunyuanVideo15Config) -> None:
        super().__init__()
        dims = cfg.block_out_channels
        self.out_channels = 2 * cfg.latent_channels
        self.conv_in = CausalConv3d(cfg.in_channels, dims[0])
        blocks, channels = [], dims[0]
        for i, dim in enumerate(dims):
            down = i < cfg.num_spatial
            down_channels = (dims[i + 1] if cfg.downsample_match_channel else dim) if down else None
            temporal = down and i >= cfg.num_spatial - cfg.num_temporal
            blocks.append(DownBlock3D(channels, dim, cfg.layers_per_block, down_channels,
                                      temporal))
            channels = down_channels or dim
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], self.out_channels)

    def forward(self, x: Tensor) -> Tensor:                            # (B, 3, T, H, W)
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)                                          # (B, C_top, T', h, w)
        shortcut = group_mean(x, self.out_channels)
        return self.conv_out(nn.functional.silu(self.norm_out(x))) + shortcut   # (B, 2z, ..)


class Decoder3D(nn.Module):
    def __init__(self, cfg: AutoencoderKLHunyuanVideo15Config) -> None:
        super().__init__()
        dims = cfg.block_out_channels[::-1]
        self.repeats = dims[0] // cfg.latent_channels
        self.conv_in = CausalConv3d(cfg.latent_channels, dims[0])
        self.mid_block = MidBlock(dims[0])
        blocks, channels = [], dims[0]
        for i, dim in enumerate(dims):
            temporal = i < cfg.num_temporal
            up = i < cfg.num_spatial or temporal
            up_channels = (dims[i + 1] if cfg.upsample_match_channel else dim) if up else None
            blocks.append(UpBlock3D(channels, dim, cfg.layers_per_block + 1, up_channels,
                                    temporal))
            channels = up_channels or dim
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], cfg.out_channels)

    def forward(self, z: Tensor) -> Tensor:                            # (B, z, T', h, w)
        x = self.conv_in(z) + z.repeat_interleave(self.repeats, dim=1)
        x = self.mid_block(x)
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(nn.functional.silu(self.norm_out(x)))    # (B, 3, T, H, W)


class AutoencoderKLHunyuanVideo15(nn.Module):
    """Encode videos to raw latents and back; `from_pretrained` loads a diffusers `vae/`."""

    def __init__(self, cfg: AutoencoderKLHunyuanVideo15Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder3D(cfg)
        self.decoder = Decoder3D(cfg)

    # ---- encode ----

    def _check_videos(self, videos: Tensor) -> None:
        _check_5d(videos, "videos")
        r, t = self.cfg.downscale, self.cfg.temporal_downscale
        num_frames, height, width = videos.shape[2:]
        if videos.shape[1] != self.cfg.in_channels:
            raise ValueError(f"videos: {videos.shape[1]} channels, the VAE takes "
                             f"{self.cfg.in_channels}")
        if (num_frames - 1) % t:
            raise ValueError(f"videos: {num_frames} frames; the encoder takes 1 + {t} k")
        if height % r or width % r:
            raise ValueError(f"videos: {height}x{width} pixels; height and width must be "
                             f"multiples of the VAE's spatial factor {r}")

    def moments(self, videos: Tensor) -> tuple[Tensor, Tensor]:
        """videos (B, 3, T, H, W) in [-1, 1] -> posterior mean, logvar (B, z, T', h, w)."""
        self._check_videos(videos)
        mean, logvar = self.encoder(videos).chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def encode(self, videos: Tensor) -> Tensor:
        """-> posterior mean (B, z, T', h, w), raw; `retrieve_latents(..., "argmax")`."""
        self._check_videos(videos)
        return self.encoder(videos).chunk(2, dim=1)[0]

    def encode_tiled(self, videos: Tensor, tile: int = TILE, overlap: float = TILE_OVERLAP
                     ) -> Tensor:
        """`encode` in overlapping tiles of `tile` pixels, as diffusers with
        `enable_tiling(tile, tile, tile // r, tile // r, overlap)` (its defaults: 256, 0.25).
        Videos that fit in one tile encode untiled."""
        self._check_videos(videos)
        if videos.shape[3] <= tile and videos.shape[4] <= tile:
            return self.encode(videos)
        r = self.cfg.downscale
        stride, lat_tile = int(tile * (1 - overlap)), tile // r
        keep = lat_tile - int(lat_tile * overlap)
        moments = _tiled(self.encoder, videos, (tile, tile), (stride, stride),
                         blend=(lat_tile - keep,) * 2, keep=(keep, keep),
                         size=(videos.shape[3] // r, videos.shape[4] // r))
        return moments.chunk(2, dim=1)[0]

    # ---- decode ----

    def _check_latents(self, latents: Tensor) -> None:
        _check_5d(latents, "latents")
        if latents.shape[1] != self.cfg.latent_channels:
            raise ValueError(f"latents: {latents.shape[1]} channels, the VAE has "
                             f"latent_channels={self.cfg.latent_channels}")

    def decode(self, latents: Tensor) -> Tensor:
        """raw latents (B, z, T', h, w) -> videos (B, 3, 1 + t (T' - 1), r h, r w), about
        [-1, 1] but not clamped (diffusers' `.decode(z).sample`)."""
        self._check_latents(latents)
        return self.decoder(latents)

    def decode_tiled(self, latents: Tensor, tile: int = TILE, overlap: float = TILE_OVERLAP
                     ) -> Tensor:
        """`decode` in overlapping tiles of tile // r latents (tile pixels out), blended over
        tile * overlap pixels, as diffusers with `enable_tiling()` (tile 256, overlap 0.25:
        16-latent tiles every 12). Latents that fit in one tile decode untiled."""
        self._check_latents(latents)
        r = self.cfg.downscale
        lat_tile = tile // r
        if latents.shape[3] <= lat_tile and latents.shape[4] <= lat_tile:
            return self.decode(latents)
        stride, keep = int(lat_tile * (1 - overlap)), tile - int(tile * overlap)
        return _tiled(self.decoder, latents, (lat_tile, lat_tile), (stride, stride),
                      blend=(tile - keep,) * 2, keep=(keep, keep),
                      size=(latents.shape[3] * r, latents.shape[4] * r))

    # ---- diffusion space ----

    def normalize(self, latents: Tensor) -> Tensor:      # raw -> the diffusion model's space
        return latents * self.cfg.scaling_factor

    def denormalize(self, latents: Tensor) -> Tensor:
        return latents / self.cfg.scaling_factor

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> AutoencoderKLHunyuanVideo15:
        """Build from a diffusers `vae/` folder in `dtype` (None: the checkpoint's). Missing,
        unexpected or mis-shaped tensors raise ValueError naming them."""
        path = Path(path)
        cfg = config_from_dict(AutoencoderKLHunyuanVideo15Config, read_config(path),
                               "AutoencoderKLHunyuanVideo15")
        return build_from_folder(cls, cfg, path, device, dtype)


def _check_5d(x: Tensor, name: str) -> None:
    if x.dim() != 5:
        raise ValueError(f"{name}: expected (B, C, T, H, W) (an image is T = 1), got "
                         f"{tuple(x.shape)}")
