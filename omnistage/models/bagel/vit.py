"""BAGEL's image encoder for understanding: SigLIP on packed patches (NaViT-style, any aspect),
its patch embedding a Linear over (p, p, c)-ordered patch pixels, learned position embeddings
indexed by `row * max_side + col`; then the MLP connector into the LLM's width and a fixed
2-D position table added on top (the checkpoint's `vit_pos_embed.pos_embed`).

    pixels (3, H, W) in [-1, 1] -> patches (h*w, p*p*3) -> SigLIP layers (full attention within
    the image) -> post LayerNorm -> connector (fc1, gelu-tanh, fc2) -> + vit_pos_embed -> (h*w, D)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.bagel.config import BagelViTConfig


def patchify(image: Tensor, p: int) -> Tensor:
    """(C, H, W) -> (H/p * W/p, p*p*C), rows in raster order, each patch (p, p, C)-ordered."""
    c, h, w = image.shape
    assert h % p == 0 and w % p == 0, (h, w, p)
    x = image.reshape(c, h // p, p, w // p, p).permute(1, 3, 2, 4, 0)
    return x.reshape(-1, p * p * c)


def grid_position_ids(h: int, w: int, max_side: int, device: torch.device | None = None
                      ) -> Tensor:
    """Flattened ids `row * max_side + col` of an h x w grid (extrapolated, not resized)."""
    rows = torch.arange(h, device=device)[:, None] * max_side
    return (rows + torch.arange(w, device=device)[None, :]).flatten()


class SiglipAttention(nn.Module):
    def __init__(self, cfg: BagelViTConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:                       # x: (T, D), one image
        t, d = x.shape
        q, k, v = (p(x).view(t, self.num_heads, -1).transpose(0, 1)
                   for p in (self.q_proj, self.k_proj, self.v_proj))   # (H, T, Dh)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(0, 1).reshape(t, d))


class SiglipMLP(nn.Module):
    def __init__(self, cfg: BagelViTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: BagelViTConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: BagelViTConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(cfg.num_channels * cfg.patch_size ** 2, cfg.hidden_size)
        self.position_embedding = nn.Embedding(cfg.num_positions, cfg.hidden_size)


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: BagelViTConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.num_layers))


class SiglipVisionTransformer(nn.Module):
    def __init__(self, cfg: BagelViTConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, patches: Tensor, position_ids: Tensor) -> Tensor:
        """patches (T, p*p*C), position_ids (T,) -> (T, D)."""
        x = self.embeddings.patch_embedding(patches)
        x = x + self.embeddings.position_embedding(position_ids)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class SiglipVisionModel(nn.Module):
    """`vit_model.*` of the checkpoint."""

    def __init__(self, cfg: BagelViTConfig) -> None:
        super().__init__()
        self.vision_model = SiglipVisionTransformer(cfg)


class MLPconnector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(in_dim, out_dim), nn.Linear(out_dim, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class PositionEmbedding(nn.Module):
    """A fixed (max_side**2, D) table, read from the checkpoint, gathered by grid ids."""

    def __init__(self, max_side: int, hidden_size: int) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(max_side ** 2, hidden_size),
                                      requires_grad=False)

    def forward(self, position_ids: Tensor) -> Tensor:
        return self.pos_embed[position_ids]
