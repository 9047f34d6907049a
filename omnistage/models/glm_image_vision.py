"""GLM-Image's image tokenizer: the vision tower and VQ codebook of transformers'
`GlmImageForConditionalGeneration` (`model.visual`, `model.vqmodel`), which turn an editing
request's condition image into the visual tokens its AR prompt carries (and the DiT's prior
for that image). Numerics follow transformers' modeling_glm_image.py op for op.

    pixel rows (N, 3*p*p), the processor's patches of one image, grid (h, w), N = h*w
      -> patch_embed: one p x p conv -> (N, D)
      -> + the learned position table (S x S), sampled bilinearly at each patch's centre
      -> depth x [LayerNorm, full attention over the image, LayerNorm, GELU MLP]
      -> (D, h, w) -> quant_conv (1x1) -> L2-normalised, nearest L2-normalised code -> (N,) ids

Every tensor of `model.vqmodel.` but `post_quant_conv` (the VQ decoder's, unused) loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig


@dataclass(frozen=True, slots=True)
class GlmImageVisionConfig:
    hidden_size: int
    num_heads: int
    depth: int
    intermediate_size: int
    patch_size: int
    in_channels: int
    layer_norm_eps: float
    attention_bias: bool
    num_positions: int          # the learned position table's, S*S
    embed_dim: int              # the VQ codebook's
    num_embeddings: int
    latent_channels: int

    @classmethod
    def from_hf(cls, hf_config: PretrainedConfig) -> GlmImageVisionConfig:
        """config.json's vision_config and vq_config."""
        v, q = hf_config.vision_config, hf_config.vq_config
        if v.spatial_merge_size != 1 or v.hidden_act != "gelu":
            raise ValueError(f"GLM-Image vision: spatial_merge_size {v.spatial_merge_size} / "
                             f"hidden_act {v.hidden_act!r}: only 1 / 'gelu' are supported")
        return cls(v.hidden_size, v.num_heads, v.depth, v.intermediate_size, v.patch_size,
                   v.in_channels, v.layer_norm_eps, v.attention_bias,
                   (v.image_size // v.patch_size) ** 2, q.embed_dim, q.num_embeddings,
                   q.latent_channels)


class GlmImageVisionPatchEmbed(nn.Module):
    def __init__(self, cfg: GlmImageVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        p = cfg.patch_size
        self.proj = nn.Conv2d(cfg.in_channels, cfg.hidden_size, kernel_size=p, stride=p)

    def forward(self, pixels: Tensor) -> Tensor:                   # (N, C*p*p) -> (N, D)
        p = self.cfg.patch_size
        x = pixels.view(-1, self.cfg.in_channels, p, p).to(self.proj.weight.dtype)
        return self.proj(x).view(-1, self.cfg.hidden_size)


class GlmImageVisionEmbeddings(nn.Module):
    """The S x S position table resampled to the image's grid (bilinear at patch centres,
    borders clamped), in float32 as transformers does."""

    def __init__(self, cfg: GlmImageVisionConfig) -> None:
        super().__init__()
        self.position_embedding = nn.Embedding(cfg.num_positions, cfg.hidden_size)

    def forward(self, x: Tensor, grid_h: int, grid_w: int) -> Tensor:      # x: (N, D)
        weight = self.position_embedding.weight
        side = int(weight.shape[0] ** 0.5)
        table = weight.view(side, side, -1).permute(2, 0, 1)[None].float()   # (1, D, S, S)
        rows = torch.arange(grid_h, device=x.device).repeat_interleave(grid_w).float()
        cols = torch.arange(grid_w, device=x.device).repeat(grid_h).float()
        grid = torch.stack([(cols + 0.5) / grid_w * 2 - 1, (rows + 0.5) / grid_h * 2 - 1],
                           dim=-1)[None, :, None]                            # (1, N, 1, 2)
        pos = F.grid_sample(table, grid, mode="bilinear", align_corners=False,
                            padding_mode="border")                           # (1, D, N, 1)
        return x + pos[0, :, :, 0].t().to(weight.dtype)


class GlmImageVisionAttention(nn.Module):
    def __init__(self, cfg: GlmImageVisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: Tensor) -> Tensor:                      # x: (N, D), one image
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).permute(1, 2, 0, 3)  # (H, N, hd)
        out = F.scaled_dot_product_attention(q, k, v)                            # (H, N, hd)
        return self.proj(out.transpose(0, 1).reshape(n, -1))


class GlmImageVisionMLP(nn.Module):
    def __init__(self, cfg: GlmImageVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class GlmImageVisionBlock(nn.Module):
    def __init__(self, cfg: GlmImageVisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = GlmImageVisionAttention(cfg)
        self.mlp = GlmImageVisionMLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GlmImageVisionModel(nn.Module):
    def __init__(self, cfg: GlmImageVisionConfig) -> None:
        super().__init__()
        self.patch_embed = GlmImageVisionPatchEmbed(cfg)
        self.embeddings = GlmImageVisionEmbeddings(cfg)
        self.blocks = nn.ModuleList(GlmImageVisionBlock(cfg) for _ in range(cfg.depth))

    def forward(self, pixels: Tensor, grid_h: int, grid_w: int) -> Tensor:
        """One image's patch rows (h*w, C*p*p), row-major -> features (h*w, D)."""
        x = self.embeddings(self.patch_embed(pixels), grid_h, grid_w)
        for block in self.blocks:
            x = block(x)
        return x


class GlmImageVQVAEVectorQuantizer(nn.Module):
    def __init__(self, cfg: GlmImageVisionConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(cfg.num_embeddings, cfg.embed_dim)

    def forward(self, z: Tensor) -> Tensor:
        """(N, E) -> the nearest code of each row by L2 distance, both sides normalised,
        in transformers' expanded form (z^2 + e^2 - 2ze): ties break as there."""
        z = F.normalize(z, p=2, dim=-1)
        codes = F.normalize(self.embedding.weight, p=2, dim=-1)               # (K, E)
        dist = (z ** 2).sum(1, keepdim=True) + (codes ** 2).sum(1) - 2 * z @ codes.t()
        return dist.argmin(dim=1)                                            # (N,)


class GlmImageVQVAE(nn.Module):
    """The encoder half of the VQ model: features -> codebook ids."""

    def __init__(self, cfg: GlmImageVisionConfig) -> None:
        super().__init__()
        self.quant_conv = nn.Conv2d(cfg.latent_channels, cfg.embed_dim, 1)
        self.quantize = GlmImageVQVAEVectorQuantizer(cfg)

    def forward(self, features: Tensor, grid_h: int, grid_w: int) -> Tensor:
        """(h*w, D) -> (h*w,) ids."""
        x = features.t().reshape(1, -1, grid_h, grid_w)                      # (1, D, h, w)
        z = self.quant_conv(x)[0].flatten(1).t()                            # (h*w, E)
        return self.quantize(z)
