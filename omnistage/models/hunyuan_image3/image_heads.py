"""The image ends of HunyuanImage-3.0's transformer: timestep embedders and the UNet-style patch
embedding in (latents -> tokens) and final layer out (tokens -> velocity), both conditioned on
the timestep through adaptive group norm.

    TimestepEmbedder  t -> [cos(t f), sin(t f)] (256) -> Linear -> GELU -> Linear
    ResBlock          GN-SiLU-conv3x3; h = GN(h) (1 + scale) + shift, (scale, shift) = Lin(SiLU(emb));
                      SiLU-conv3x3; + skip (1x1 conv when the channels change)
    PatchEmbed        conv3x3 (C_lat -> C_hid), ResBlock(C_hid -> H); tokens row-major (h w)
    FinalLayer        ResBlock(H -> C_hid), GN-SiLU-conv3x3 (C_hid -> C_lat)
Module names follow the checkpoint (patch_embed.model.0, final_layer.model.1.2, ...); patch
size 1 only (the released checkpoint's)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs.to(t.device)[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden_size), nn.GELU(),
                                 nn.Linear(hidden_size, hidden_size))

    def forward(self, t: Tensor) -> Tensor:                      # (B,) -> (B, H)
        return self.mlp(timestep_embedding(t, self.freq_dim).to(self.mlp[0].weight.dtype))


class ResBlock(nn.Module):
    def __init__(self, in_ch: int, emb_ch: int, out_ch: int) -> None:
        super().__init__()
        self.in_layers = nn.Sequential(nn.GroupNorm(32, in_ch), nn.SiLU(),
                                       nn.Conv2d(in_ch, out_ch, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_ch, 2 * out_ch))
        self.out_layers = nn.Sequential(nn.GroupNorm(32, out_ch), nn.SiLU(), nn.Dropout(0.0),
                                        nn.Conv2d(out_ch, out_ch, 3, padding=1))
        self.skip_connection = nn.Identity() if in_ch == out_ch else nn.Conv2d(in_ch, out_ch, 1)

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:        # x (B, C, h, w), emb (B, E)
        h = self.in_layers(x)
        scale, shift = self.emb_layers(emb)[..., None, None].chunk(2, dim=1)
        h = self.out_layers[0](h) * (1.0 + scale) + shift
        h = self.out_layers[3](F.silu(h))
        return self.skip_connection(x) + h


class PatchEmbed(nn.Module):
    def __init__(self, latent_ch: int, hidden_ch: int, hidden_size: int) -> None:
        super().__init__()
        self.model = nn.ModuleList([nn.Conv2d(latent_ch, hidden_ch, 3, padding=1),
                                    ResBlock(hidden_ch, hidden_size, hidden_size)])

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:        # (B, C, h, w) -> (B, h*w, H)
        x = self.model[1](self.model[0](x), emb)
        return x.flatten(2).transpose(1, 2)


class FinalLayer(nn.Module):
    def __init__(self, hidden_size: int, hidden_ch: int, latent_ch: int) -> None:
        super().__init__()
        self.model = nn.ModuleList([
            ResBlock(hidden_size, hidden_size, hidden_ch),
            nn.Sequential(nn.GroupNorm(32, hidden_ch), nn.SiLU(),
                          nn.Conv2d(hidden_ch, latent_ch, 3, padding=1))])

    def forward(self, x: Tensor, emb: Tensor, h: int, w: int) -> Tensor:
        x = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], h, w)  # (B, h*w, H) -> (B, H, h, w)
        return self.model[1](self.model[0](x, emb))
