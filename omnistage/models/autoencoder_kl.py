"""The image VAE of FLUX.1 and SD3: diffusers' `AutoencoderKL` (2-D) in plain PyTorch.

Module and parameter names follow diffusers, so a pipeline's `vae/` folder loads by name
(`AutoencoderKL.from_pretrained`); numerics follow `diffusers/models/autoencoders/vae.py` and
`autoencoder_kl.py` op for op.

    images (B,3,H,W) in [-1,1] -> Encoder -> quant_conv? -> (B,2C,h,w) = [mean | logvar]
    latents (B,C,h,w) -> post_quant_conv? -> Decoder -> images (B,3,H,W)

h = H / 2**(len(block_out_channels) - 1). `encode` / `decode` work on raw latents, as diffusers'
do; the diffusion space is `(z - shift_factor) * scaling_factor` (`normalize` / `denormalize`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.diffusers_loader import build_from_folder, read_config

EPS = 1e-6   # every GroupNorm of the VAE
UNTILED_MAX_PIXELS = 2048 * 2048   # `decode_images`: pixels decoded whole in one call


@dataclass(frozen=True, slots=True)
class AutoencoderKLConfig:
    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",)
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None   # stored, unused (not read by FLUX / SD3)
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    def __post_init__(self) -> None:
        n = len(self.block_out_channels)
        for key, kind in (("down_block_types", "DownEncoderBlock2D"),
                          ("up_block_types", "UpDecoderBlock2D")):
            if getattr(self, key) != (kind,) * n:
                raise ValueError(f"{key} {getattr(self, key)}: only {n} x {kind} is supported")
        if self.act_fn != "silu":
            raise ValueError(f"act_fn {self.act_fn!r}: only 'silu' is supported")

    @property
    def downscale(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def decoder_channels(self) -> tuple[int, ...]:
        """The decoder's block widths (FLUX.2's VAE may give its own)."""
        return self.block_out_channels

    @classmethod
    def from_dict(cls, raw: dict) -> AutoencoderKLConfig:
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"AutoencoderKL config: unknown keys {unknown}")
        raw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
        if isinstance(raw.get("sample_size"), tuple):   # diffusers allows (H, W); tiling uses H
            raw["sample_size"] = raw["sample_size"][0]
        return cls(**raw)


# ---- blocks --------------------------------------------------------------------------------

class ResnetBlock2D(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_ch, eps=EPS)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, out_ch, eps=EPS)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else None

    def forward(self, x: Tensor) -> Tensor:                      # x: (B, in, H, W)
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))                    # (B, out, H, W)
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class Attention(nn.Module):
    """Single-head spatial self-attention with a residual (diffusers' deprecated VAE attn block)."""

    def __init__(self, ch: int, groups: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, ch, eps=EPS)
        self.to_q, self.to_k, self.to_v = nn.Linear(ch, ch), nn.Linear(ch, ch), nn.Linear(ch, ch)
        self.to_out = nn.ModuleList([nn.Linear(ch, ch)])         # to_out.0; diffusers' .1 is dropout

    def forward(self, x: Tensor) -> Tensor:                      # x: (B, C, H, W)
        b, c, hgt, wid = x.shape
        h = self.group_norm(x).flatten(2).transpose(1, 2)        # (B, HW, C)
        q, k, v = (proj(h)[:, None] for proj in (self.to_q, self.to_k, self.to_v))  # (B, 1, HW, C)
        h = F.scaled_dot_product_attention(q, k, v)[:, 0]        # (B, HW, C)
        h = self.to_out[0](h).transpose(1, 2).reshape(b, c, hgt, wid)
        return h + x


class UNetMidBlock2D(nn.Module):
    def __init__(self, ch: int, groups: int, add_attention: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock2D(ch, ch, groups) for _ in range(2)])
        self.attentions = nn.ModuleList([Attention(ch, groups)] if add_attention else [])

    def forward(self, x: Tensor) -> Tensor:
        x = self.resnets[0](x)
        for attn in self.attentions:
            x = attn(x)
        return self.resnets[1](x)


class Downsample2D(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=0)

    def forward(self, x: Tensor) -> Tensor:                      # (B, C, H, W) -> (B, C, H/2, W/2)
        return self.conv(F.pad(x, (0, 1, 0, 1)))                 # asymmetric pad, as diffusers


class Upsample2D(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:                      # (B, C, H, W) -> (B, C, 2H, 2W)
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class DownEncoderBlock2D(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, num_layers: int, groups: int, add_down: bool
                 ) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResnetBlock2D(in_ch if i == 0 else out_ch, out_ch, groups) for i in range(num_layers)])
        self.downsamplers = nn.ModuleList([Downsample2D(out_ch)] if add_down else [])

    def forward(self, x: Tensor) -> Tensor:
        for layer in [*self.resnets, *self.downsamplers]:
            x = layer(x)
        return x


class UpDecoderBlock2D(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, num_layers: int, groups: int, add_up: bool
                 ) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResnetBlock2D(in_ch if i == 0 else out_ch, out_ch, groups) for i in range(num_layers)])
        self.upsamplers = nn.ModuleList([Upsample2D(out_ch)] if add_up else [])

    def forward(self, x: Tensor) -> Tensor:
        for layer in [*self.resnets, *self.upsamplers]:
            x = layer(x)
        return x


class Encoder(nn.Module):
    def __init__(self, cfg: AutoencoderKLConfig) -> None:
        super().__init__()
        chs, g, n = cfg.block_out_channels, cfg.norm_num_groups, len(cfg.block_out_channels)
        self.conv_in = nn.Conv2d(cfg.in_channels, chs[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            [DownEncoderBlock2D(chs[max(i - 1, 0)], chs[i], cfg.layers_per_block, g, i < n - 1)
             for i in range(n)])
        self.mid_block = UNetMidBlock2D(chs[-1], g, cfg.mid_block_add_attention)
        self.conv_norm_out = nn.GroupNorm(g, chs[-1], eps=EPS)
        self.conv_out = nn.Conv2d(chs[-1], 2 * cfg.latent_channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:                      # x: (B, 3, H, W)
        x = self.conv_in(x)                                      # (B, ch0, H, W)
        for block in self.down_blocks:
            x = block(x)                                         # ... -> (B, ch[-1], h, w)
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))      # (B, 2C, h, w)


class Decoder(nn.Module):
    def __init__(self, cfg: AutoencoderKLConfig) -> None:
        super().__init__()
        chs, g, n = cfg.decoder_channels[::-1], cfg.norm_num_groups, len(cfg.decoder_channels)
        self.conv_in = nn.Conv2d(cfg.latent_channels, chs[0], 3, padding=1)
        self.mid_block = UNetMidBlock2D(chs[0], g, cfg.mid_block_add_attention)
        self.up_blocks = nn.ModuleList(
            [UpDecoderBlock2D(chs[max(i - 1, 0)], chs[i], cfg.layers_per_block + 1, g, i < n - 1)
             for i in range(n)])
        self.conv_norm_out = nn.GroupNorm(g, chs[-1], eps=EPS)
        self.conv_out = nn.Conv2d(chs[-1], cfg.out_channels, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:                      # z: (B, C, h, w)
        x = self.mid_block(self.conv_in(z))                      # (B, ch[-1], h, w)
        for block in self.up_blocks:
            x = block(x)                                         # ... -> (B, ch0, H, W)
        return self.conv_out(F.silu(self.conv_norm_out(x)))      # (B, 3, H, W)


# ---- model ---------------------------------------------------------------------------------

class AutoencoderKL(nn.Module):
    config_cls = AutoencoderKLConfig

    def __init__(self, cfg: AutoencoderKLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        c = cfg.latent_channels
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quant_conv = nn.Conv2d(2 * c, 2 * c, 1) if cfg.use_quant_conv else None
        self.post_quant_conv = nn.Conv2d(c, c, 1) if cfg.use_post_quant_conv else None

    def _moments(self, images: Tensor) -> tuple[Tensor, Tensor]:
        h = self.encoder(images)                                 # (B, 2C, h, w)
        h = h if self.quant_conv is None else self.quant_conv(h)
        mean, logvar = h.chunk(2, dim=1)                         # (B, C, h, w) each
        return mean, logvar.clamp(-30.0, 20.0)

    def encode(self, images: Tensor) -> Tensor:
        """images (B,3,H,W) in [-1,1] -> posterior mean (B,C,h,w), raw (not normalized)."""
        return self._moments(images)[0]

    def sample_latents(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """A posterior draw mean + std * eps; eps drawn like diffusers' `randn_tensor` on the
        generator's device, so a CPU generator reproduces `latent_dist.sample(generator)`."""
        mean, logvar = self._moments(images)
        gen_device = generator.device if generator is not None else mean.device
        eps = torch.randn(mean.shape, generator=generator, device=gen_device, dtype=mean.dtype)
        return mean + torch.exp(0.5 * logvar) * eps.to(mean.device)

    def decode(self, latents: Tensor) -> Tensor:
        """raw latents (B,C,h,w) -> images (B,3,H,W), roughly in [-1,1]."""
        if self.post_quant_conv is not None:
            latents = self.post_quant_conv(latents)              # (B, C, h, w)
        return self.decoder(latents)

    def decode_tiled(self, latents: Tensor, tile_size: int | None = None, overlap: float = 0.25
                     ) -> Tensor:
        """`decode` in overlapping latent tiles, as diffusers' `tiled_decode` with
        tile_latent_min_size = `tile_size` (default sample_size / downscale),
        tile_sample_min_size = tile_size * downscale and tile_overlap_factor = `overlap`.

            stride = tile * (1 - overlap) latents; each decoded tile's top / left `blend` pixels
            are linearly blended with the tile above / to the left, then cropped to `keep`:
            | keep | blend |            (tile_sample = keep + blend)
                   | keep | blend |

        Latents that fit in one tile decode untiled, as diffusers' `decode` does."""
        tile = tile_size or self.cfg.sample_size // self.cfg.downscale
        if latents.shape[-2] <= tile and latents.shape[-1] <= tile:
            return self.decode(latents)
        sample_tile = tile * self.cfg.downscale
        stride = int(tile * (1 - overlap))
        blend = int(sample_tile * overlap)
        keep = sample_tile - blend
        assert stride > 0, f"overlap {overlap} leaves no stride for tile {tile}"
        rows = [[self.decode(latents[:, :, i:i + tile, j:j + tile])   # (B, 3, <=S, <=S)
                 for j in range(0, latents.shape[-1], stride)]
                for i in range(0, latents.shape[-2], stride)]
        out_rows = []
        for i, row in enumerate(rows):
            for j, t in enumerate(row):   # in place, so later tiles blend with blended ones
                if i > 0:
                    _blend(rows[i - 1][j], t, blend, dim=2)
                if j > 0:
                    _blend(row[j - 1], t, blend, dim=3)
            out_rows.append(torch.cat([t[:, :, :keep, :keep] for t in row], dim=3))
        return torch.cat(out_rows, dim=2)                        # (B, 3, H, W)

    def decode_images(self, latents: Tensor, max_pixels: int = UNTILED_MAX_PIXELS) -> Tensor:
        """What a pipeline decodes with: raw latents (B,C,h,w) -> images (B,3,H,W), each
        image whole, as diffusers' pipelines decode (their VAE tiles only after
        `enable_tiling()`), as many images per call as hold `max_pixels` together; an image
        larger than `max_pixels` in tiles (`decode_tiled`), which bounds the memory at any
        size. The bound is ours, not the checkpoint's `sample_size`: a config that leaves that
        at diffusers' default (32 px) would otherwise send nearly every image through tiles,
        whose seams and per-tile GroupNorm statistics change the picture."""
        pixels = latents.shape[-2] * latents.shape[-1] * self.cfg.downscale ** 2
        if pixels > max_pixels:
            return self.decode_tiled(latents)
        per_call = max(1, max_pixels // pixels)
        return torch.cat([self.decode(chunk) for chunk in latents.split(per_call)])

    def normalize(self, latents: Tensor) -> Tensor:   # raw -> the diffusion model's space
        return (latents - (self.cfg.shift_factor or 0.0)) * self.cfg.scaling_factor

    def denormalize(self, latents: Tensor) -> Tensor:
        return latents / self.cfg.scaling_factor + (self.cfg.shift_factor or 0.0)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> AutoencoderKL:
        """Build from a diffusers `vae/` folder in `dtype` (None: the checkpoint's). Missing,
        unexpected or mis-shaped tensors raise ValueError naming them."""
        path = Path(path)
        return build_from_folder(cls, cls.config_cls.from_dict(read_config(path)), path, device,
                                 dtype)


def _blend(a: Tensor, b: Tensor, extent: int, dim: int) -> None:
    """Blend the first `extent` rows (dim=2) or columns (dim=3) of `b` in place with the last
    ones of `a`: weight of `b` rises linearly y / extent from 0, as diffusers' blend_v / blend_h."""
    extent = min(a.shape[dim], b.shape[dim], extent)
    w = torch.arange(extent, dtype=b.dtype, device=b.device) / extent     # (extent,)
    w = w.view(-1, 1) if dim == 2 else w                                   # broadcast over H or W
    tail = a.narrow(dim, a.shape[dim] - extent, extent)
    head = b.narrow(dim, 0, extent)
    head.copy_(tail * (1 - w) + head * w)
