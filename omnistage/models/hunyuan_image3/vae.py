"""HunyuanImage-3.0's VAE decoder (AutoencoderKLConv3D's `decoder.*`): Conv3D blocks whose
upsamplers are DCAE-style (a conv to r*C channels, then depth-to-space, plus a shortcut that
repeats the input's channels), single-head attention in the middle. An image is one latent frame:
the temporal upsamplers make ffactor_temporal frames and the last one is the image.

    z (B, C, 1, h, w) -> conv_in + repeat(z) -> mid (res, attn, res)
      -> per level: (layers_per_block + 1) res blocks, DCAE upsample (x2 in h, w; in t too
         while level < log2(ffactor_temporal))
      -> GN -> SiLU -> conv_out -> last frame (B, 3, 1, H, W)
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.hunyuan_image3.config import VaeConfig


def _gn(ch: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, ch, eps=1e-6)


class ResnetBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = _gn(in_ch), nn.Conv3d(in_ch, out_ch, 3, padding=1)
        self.norm2, self.conv2 = _gn(out_ch), nn.Conv3d(out_ch, out_ch, 3, padding=1)
        self.nin_shortcut = nn.Conv3d(in_ch, out_ch, 1) if in_ch != out_ch else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.norm = _gn(ch)
        self.q, self.k, self.v, self.proj_out = (nn.Conv3d(ch, ch, 1) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        b, c, f, hh, ww = x.shape
        q, k, v = (m(h).flatten(2).transpose(1, 2)[:, None] for m in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v)[:, 0]          # (B, f*h*w, C)
        return x + self.proj_out(out.transpose(1, 2).reshape(b, c, f, hh, ww))


class UpsampleDCAE(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, temporal: bool) -> None:
        super().__init__()
        self.rt = 2 if temporal else 1
        factor = self.rt * 4
        self.conv = nn.Conv3d(in_ch, out_ch * factor, 3, padding=1)
        self.repeats = factor * out_ch // in_ch

    def _to_space(self, x: Tensor) -> Tensor:   # b (r1 r2 r3 c) f h w -> b c (f r1) (h r2) (w r3)
        b, ch, f, h, w = x.shape
        c = ch // (self.rt * 4)
        x = x.reshape(b, self.rt, 2, 2, c, f, h, w).permute(0, 4, 5, 1, 6, 2, 7, 3)
        return x.reshape(b, c, f * self.rt, h * 2, w * 2)

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x.repeat_interleave(self.repeats, dim=1)
        return self._to_space(self.conv(x)) + self._to_space(shortcut)


class VaeDecoder(nn.Module):
    def __init__(self, cfg: VaeConfig) -> None:
        super().__init__()
        chans = list(reversed(cfg.block_out_channels))
        self.z_channels, self.first = cfg.latent_channels, chans[0]
        self.conv_in = nn.Conv3d(cfg.latent_channels, chans[0], 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(chans[0], chans[0])
        self.mid.attn_1 = AttnBlock(chans[0])
        self.mid.block_2 = ResnetBlock(chans[0], chans[0])
        self.up = nn.ModuleList()
        block_in = chans[0]
        for level, ch in enumerate(chans):
            up = nn.Module()
            up.block = nn.ModuleList()
            for _ in range(cfg.layers_per_block + 1):
                up.block.append(ResnetBlock(block_in, ch))
                block_in = ch
            spatial = level < math.log2(cfg.ffactor_spatial)
            temporal = level < math.log2(cfg.ffactor_temporal)
            if spatial or temporal:
                up.upsample = UpsampleDCAE(block_in, chans[level + 1], temporal)
                block_in = chans[level + 1]
            self.up.append(up)
        self.norm_out = _gn(block_in)
        self.conv_out = nn.Conv3d(block_in, cfg.out_channels, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:                 # (B, C, 1, h, w) -> (B, 3, 1, H, W)
        h = self.conv_in(z) + z.repeat_interleave(self.first // self.z_channels, dim=1)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for up in self.up:
            for block in up.block:
                h = block(h)
            if hasattr(up, "upsample"):
                h = up.upsample(h)
        h = self.conv_out(F.silu(self.norm_out(h)))
        return h[:, :, -1:]


class HunyuanImage3Vae(nn.Module):
    """`vae.decoder.*` of the checkpoint; `decode` takes the denoised latents (B, C, h, w)."""

    def __init__(self, cfg: VaeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.decoder = VaeDecoder(cfg)

    def decode(self, latents: Tensor) -> Tensor:         # -> (B, 3, H, W) in [-1, 1] (unclamped)
        z = latents / self.cfg.scaling_factor + self.cfg.shift_factor
        return self.decoder(z.unsqueeze(2))[:, :, 0]
