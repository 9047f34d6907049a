"""LTX-2's video VAE: diffusers' `AutoencoderKLLTX2Video` in plain PyTorch (blocks in
`ltx2_vae_layers.py`).

    videos (B,3,T,H,W) in [-1,1] -> patchify(p) -> conv_in -> down blocks -> mid -> conv_out
        -> mean (B,z,T',h,w) | one logvar channel
    latents (B,z,T',h,w) -> conv_in -> mid -> up blocks -> norm, (modulate by t), silu
        -> conv_out -> unpatchify(p) -> videos (B,3,T,H,W), unclamped

LTX-2 (z 128): h = H / 32, T = 1 + 8 (T' - 1). The decoder may be timestep-conditioned
(`timestep_conditioning`: LTX-Video 0.9.5's decode_timestep); `decode(latents, timestep)` then
takes a (B,) tensor. The diffusion space is `(z - mean) / std * scaling_factor`, the per-channel
statistics stored in the checkpoint (`normalize` / `denormalize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.diffusers_loader import build_from_folder, config_from_dict, read_config
from omnistage.models.ltx2_vae_layers import (CausalConv3d, DownBlock3D, MidBlock3d,
                                              TimeEmbedder, UpBlock3d, pixel_norm)


def _per_block(value: bool | tuple[bool, ...], n: int) -> tuple[bool, ...]:
    return (value,) * n if isinstance(value, bool) else tuple(value)


@dataclass(frozen=True, slots=True)
class AutoencoderKLLTX2VideoConfig:
    """config.json of a diffusers `AutoencoderKLLTX2Video` folder (its keys, its defaults)."""
    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 128
    block_out_channels: tuple[int, ...] = (256, 512, 1024, 2048)
    down_block_types: tuple[str, ...] = ("LTX2VideoDownBlock3D",) * 4
    decoder_block_out_channels: tuple[int, ...] = (256, 512, 1024)
    layers_per_block: tuple[int, ...] = (4, 6, 6, 2, 2)
    decoder_layers_per_block: tuple[int, ...] = (5, 5, 5, 5)
    spatio_temporal_scaling: bool | tuple[bool, ...] = (True, True, True, True)
    decoder_spatio_temporal_scaling: bool | tuple[bool, ...] = (True, True, True)
    decoder_inject_noise: bool | tuple[bool, ...] = (False, False, False, False)
    downsample_type: tuple[str, ...] = ("spatial", "temporal", "spatiotemporal", "spatiotemporal")
    upsample_type: tuple[str, ...] = ("spatiotemporal", "spatiotemporal", "spatiotemporal")
    upsample_residual: bool | tuple[bool, ...] = (True, True, True)
    upsample_factor: tuple[int, ...] = (2, 2, 2)
    timestep_conditioning: bool = False
    patch_size: int = 4
    patch_size_t: int = 1
    resnet_norm_eps: float = 1e-6
    scaling_factor: float = 1.0
    encoder_causal: bool = True
    decoder_causal: bool = True
    encoder_spatial_padding_mode: str = "zeros"
    decoder_spatial_padding_mode: str = "reflect"
    spatial_compression_ratio: int | None = None
    temporal_compression_ratio: int | None = None

    def __post_init__(self) -> None:
        unknown = set(self.down_block_types) - {"LTX2VideoDownBlock3D"}
        if unknown:
            raise ValueError(f"down_block_types: unknown {sorted(unknown)}")
        if self.patch_size_t != 1:
            raise ValueError(f"patch_size_t={self.patch_size_t}: only 1 is supported")

    @property
    def spatial_ratio(self) -> int:
        """Pixels per latent along H and W (diffusers' `spatial_compression_ratio`)."""
        scaling = _per_block(self.spatio_temporal_scaling, len(self.layers_per_block) - 1)
        return self.spatial_compression_ratio or self.patch_size * 2 ** sum(scaling)

    @property
    def temporal_ratio(self) -> int:
        """Frames per latent frame after the first."""
        scaling = _per_block(self.spatio_temporal_scaling, len(self.layers_per_block) - 1)
        return self.temporal_compression_ratio or self.patch_size_t * 2 ** sum(scaling)


class Encoder3d(nn.Module):
    def __init__(self, cfg: AutoencoderKLLTX2VideoConfig) -> None:
        super().__init__()
        pad, eps = cfg.encoder_spatial_padding_mode, cfg.resnet_norm_eps
        scaling = _per_block(cfg.spatio_temporal_scaling, len(cfg.layers_per_block) - 1)
        self.conv_in = CausalConv3d(cfg.in_channels * cfg.patch_size ** 2, cfg.latent_channels,
                                    padding_mode=pad)
        channels = cfg.latent_channels
        blocks = []
        for i, out in enumerate(cfg.block_out_channels):
            blocks.append(DownBlock3D(channels, out, cfg.layers_per_block[i], eps, scaling[i],
                                      cfg.downsample_type[i], pad))
            channels = out
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock3d(channels, cfg.layers_per_block[-1], eps, padding_mode=pad)
        self.conv_out = CausalConv3d(channels, cfg.latent_channels + 1, padding_mode=pad)

    def forward(self, x: Tensor, causal: bool) -> Tensor:     # (B, 3p^2, T, H/p, W/p)
        x = self.conv_in(x, causal)
        for block in self.down_blocks:
            x = block(x, causal)
        x = self.mid_block(x, None, causal)
        return self.conv_out(F.silu(pixel_norm(x)), causal)   # (B, z + 1, T', h, w)


class Decoder3d(nn.Module):
    def __init__(self, cfg: AutoencoderKLLTX2VideoConfig) -> None:
        super().__init__()
        pad, eps = cfg.decoder_spatial_padding_mode, cfg.resnet_norm_eps
        n = len(cfg.decoder_layers_per_block)
        channels = tuple(reversed(cfg.decoder_block_out_channels))
        scaling = tuple(reversed(_per_block(cfg.decoder_spatio_temporal_scaling, n - 1)))
        layers = tuple(reversed(cfg.decoder_layers_per_block))
        noise = tuple(reversed(_per_block(cfg.decoder_inject_noise, n)))
        residual = tuple(reversed(_per_block(cfg.upsample_residual, n - 1)))
        factor = tuple(reversed(cfg.upsample_factor))
        t_cond = cfg.timestep_conditioning
        out = channels[0]
        self.conv_in = CausalConv3d(cfg.latent_channels, out, padding_mode=pad)
        self.mid_block = MidBlock3d(out, layers[0], eps, noise[0], t_cond, pad)
        blocks = []
        for i, width in enumerate(channels):
            inp, out = out // factor[i], width // factor[i]
            blocks.append(UpBlock3d(inp, out, layers[i + 1], eps, scaling[i],
                                    cfg.upsample_type[i], noise[i + 1], t_cond, residual[i],
                                    factor[i], pad))
        self.up_blocks = nn.ModuleList(blocks)
        self.conv_out = CausalConv3d(out, cfg.out_channels * cfg.patch_size ** 2,
                                     padding_mode=pad)
        self.timestep_scale_multiplier: nn.Parameter | None = None
        self.time_embedder: TimeEmbedder | None = None
        self.scale_shift_table: nn.Parameter | None = None
        if t_cond:
            self.timestep_scale_multiplier = nn.Parameter(torch.tensor(1000.0))
            self.time_embedder = TimeEmbedder(out * 2)
            self.scale_shift_table = nn.Parameter(torch.zeros(2, out))

    def forward(self, z: Tensor, t: Tensor | None, causal: bool) -> Tensor:
        x = self.conv_in(z, causal)
        if self.timestep_scale_multiplier is not None:
            assert t is not None, "a timestep-conditioned decoder needs the timestep"
            t = t * self.timestep_scale_multiplier
        x = self.mid_block(x, t, causal)
        for block in self.up_blocks:
            x = block(x, t, causal)
        x = pixel_norm(x)
        if self.time_embedder is not None and self.scale_shift_table is not None:
            mod = self.time_embedder(t, x).unflatten(1, (2, -1))
            shift, scale = (mod + self.scale_shift_table[None, ..., None, None, None]).unbind(1)
            x = x * (1 + scale) + shift
        return self.conv_out(F.silu(x), causal)             # (B, 3p^2, T, H/p, W/p)


def patchify(x: Tensor, p: int) -> Tensor:
    """(B, C, T, H, W) -> (B, C p p, T, H/p, W/p), channel order (c, pw, ph) as diffusers."""
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t, h // p, p, w // p, p).permute(0, 1, 6, 4, 2, 3, 5)
    return x.reshape(b, c * p * p, t, h // p, w // p)


def unpatchify(x: Tensor, p: int) -> Tensor:
    """The inverse of `patchify`."""
    b, cpp, t, h, w = x.shape
    x = x.reshape(b, cpp // (p * p), p, p, t, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, cpp // (p * p), t, h * p, w * p)


class AutoencoderKLLTX2Video(nn.Module):
    """Encode videos to raw latents and back; `from_pretrained` loads a diffusers `vae/`."""

    def __init__(self, cfg: AutoencoderKLLTX2VideoConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder3d(cfg)
        self.decoder = Decoder3d(cfg)
        # buffers in diffusers (persistent: stored in the checkpoint); parameters here so the
        # strict loader reads them like every other tensor
        self.latents_mean = nn.Parameter(torch.zeros(cfg.latent_channels), requires_grad=False)
        self.latents_std = nn.Parameter(torch.ones(cfg.latent_channels), requires_grad=False)

    # ---- encode ----

    def _check_videos(self, videos: Tensor) -> None:
        _check_5d(videos, "videos")
        r, rt = self.cfg.spatial_ratio, self.cfg.temporal_ratio
        num_frames, height, width = videos.shape[2:]
        if videos.shape[1] != self.cfg.in_channels:
            raise ValueError(f"videos: {videos.shape[1]} channels, the VAE takes "
                             f"{self.cfg.in_channels}")
        if (num_frames - 1) % rt:
            raise ValueError(f"videos: {num_frames} frames; the encoder takes 1 + {rt} k")
        if height % r or width % r:
            raise ValueError(f"videos: {height}x{width} pixels; height and width must be "
                             f"multiples of the VAE's spatial factor {r}")

    def moments(self, videos: Tensor) -> tuple[Tensor, Tensor]:
        """videos (B, 3, T, H, W) in [-1, 1] -> posterior mean, logvar (B, z, T', h, w); the
        encoder's one logvar channel serves every latent channel, as in diffusers."""
        self._check_videos(videos)
        out = self.encoder(patchify(videos, self.cfg.patch_size), self.cfg.encoder_causal)
        z = self.cfg.latent_channels
        return out[:, :z], out[:, z:].expand_as(out[:, :z]).clamp(-30.0, 20.0)

    def encode(self, videos: Tensor) -> Tensor:
        """-> posterior mean (B, z, T', h, w), raw; `retrieve_latents(..., "argmax")`."""
        return self.moments(videos)[0]

    # ---- decode ----

    def _check_latents(self, latents: Tensor, timestep: Tensor | None) -> None:
        _check_5d(latents, "latents")
        if latents.shape[1] != self.cfg.latent_channels:
            raise ValueError(f"latents: {latents.shape[1]} channels, the VAE has "
                             f"latent_channels={self.cfg.latent_channels}")
        if self.cfg.timestep_conditioning and (timestep is None
                                               or timestep.shape != latents.shape[:1]):
            raise ValueError("timestep: this VAE's decoder is timestep-conditioned and needs "
                             f"one value per video, shape ({latents.shape[0]},)")

    def decode(self, latents: Tensor, timestep: Tensor | None = None) -> Tensor:
        """raw latents (B, z, T', h, w) (and, for a timestep-conditioned decoder, timestep
        (B,)) -> videos (B, 3, 1 + rt (T' - 1), h r, w r), unclamped as diffusers'."""
        self._check_latents(latents, timestep)
        out = self.decoder(latents, timestep, self.cfg.decoder_causal)
        return unpatchify(out, self.cfg.patch_size)

    def decode_tiled(self, latents: Tensor, timestep: Tensor | None = None,
                     tile: tuple[int, int] = (512, 512),
                     stride: tuple[int, int] = (448, 448)) -> Tensor:
        """`decode` in overlapping spatial tiles, as diffusers with `enable_tiling(tile_sample_
        min_height/width=tile, tile_sample_stride_height/width=stride)`: latent tiles of
        tile // r with stride // r, decoded tiles blended over tile - stride pixels. Latents
        that fit in one tile decode untiled."""
        from omnistage.models.autoencoder_kl_wan import _tiled   # same blend as Wan's
        self._check_latents(latents, timestep)
        r = self.cfg.spatial_ratio
        in_tile, in_stride = (tile[0] // r, tile[1] // r), (stride[0] // r, stride[1] // r)
        if latents.shape[3] <= in_tile[0] and latents.shape[4] <= in_tile[1]:
            return self.decode(latents, timestep)

        def one(z: Tensor) -> Tensor:
            return unpatchify(self.decoder(z, timestep, self.cfg.decoder_causal),
                              self.cfg.patch_size)

        return _tiled(one, latents, in_tile, in_stride,
                      blend=(tile[0] - stride[0], tile[1] - stride[1]), keep=stride,
                      size=(latents.shape[3] * r, latents.shape[4] * r))

    # ---- diffusion space ----

    def _stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        shape = (1, -1, 1, 1, 1)
        return (self.latents_mean.view(shape).to(like.device, like.dtype),
                self.latents_std.view(shape).to(like.device, like.dtype))

    def normalize(self, latents: Tensor) -> Tensor:      # raw -> the diffusion model's space
        mean, std = self._stats(latents)
        return (latents - mean) * self.cfg.scaling_factor / std

    def denormalize(self, latents: Tensor) -> Tensor:
        mean, std = self._stats(latents)
        return latents * std / self.cfg.scaling_factor + mean

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> AutoencoderKLLTX2Video:
        """Build from a diffusers `vae/` folder in `dtype` (None: the checkpoint's). Missing,
        unexpected or mis-shaped tensors raise ValueError naming them."""
        path = Path(path)
        cfg = config_from_dict(AutoencoderKLLTX2VideoConfig, read_config(path),
                               "AutoencoderKLLTX2Video")
        return build_from_folder(cls, cfg, path, device, dtype)


def _check_5d(x: Tensor, name: str) -> None:
    if x.dim() != 5:
        raise ValueError(f"{name}: expected (B, C, T, H, W) (an image is T = 1), got "
                         f"{tuple(x.shape)}")
