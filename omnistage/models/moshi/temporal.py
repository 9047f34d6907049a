"""Moshi's temporal transformer (transformers' `MoshiForCausalLM` inside Moshi): one position
per 12.5 Hz frame, whose input is the sum of the frame's text-token embedding (the inner
monologue) and 2K audio-code embeddings (K of Moshi's own stream, K of the user's); RMSNorm,
rope attention, a SiLU-gated MLP; its final-norm hidden state feeds both the text head and
the depth transformer. Module names follow the checkpoint's `decoder.*` tensors.

The key/value cache is plain tensors per layer (B, Hkv, L, D); batched prompts of different
lengths are left-padded, each row rotated at its own positions, pads masked out as keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.activation import SiluAndMul
from omnistage.layers.linear import Linear
from omnistage.layers.norm import RMSNorm
from omnistage.layers.rotary import RotaryEmbedding, get_rope
from omnistage.models.moshi.config import MoshiConfig

KVCache = list[list[Tensor]]


class Proj(nn.Module):
    """The checkpoint's `q_proj.linear.weight` nesting."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = Linear(in_features, out_features)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


class MoshiAttention(nn.Module):
    def __init__(self, cfg: MoshiConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = Proj(h, self.num_heads * self.head_dim)
        self.k_proj = Proj(h, self.num_kv_heads * self.head_dim)
        self.v_proj = Proj(h, self.num_kv_heads * self.head_dim)
        self.o_proj = Proj(self.num_heads * self.head_dim, h)
        self.rotary = rotary

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor, cache: list[Tensor]
                ) -> Tensor:
        """x (B, T, hidden), positions (B, T), mask (B, T, L_past + T) bool; cache extended."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions.reshape(-1), q.reshape(b * t, self.num_heads, -1),
                           k.reshape(b * t, self.num_kv_heads, -1))   # rows at own positions
        q, k = q.view(b, t, self.num_heads, -1), k.view(b, t, self.num_kv_heads, -1)
        k, v = k.transpose(1, 2), v.transpose(1, 2)                # (B, Hkv, T, D)
        if cache:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        cache[:] = [k, v]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None],
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class GatingMLP(nn.Module):
    def __init__(self, cfg: MoshiConfig) -> None:
        super().__init__()
        self.fc1 = Linear(cfg.hidden_size, cfg.ffn_dim)
        self.fc2 = Linear(cfg.ffn_dim // 2, cfg.hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class MoshiDecoderLayer(nn.Module):
    def __init__(self, cfg: MoshiConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MoshiAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatingMLP(cfg)

    def forward(self, h: Tensor, positions: Tensor, mask: Tensor, cache: list[Tensor]
                ) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class MoshiModel(nn.Module):
    def __init__(self, cfg: MoshiConfig) -> None:
        super().__init__()
        rotary = get_rope(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.embed_tokens = nn.Embedding(cfg.vocab_size + 1, cfg.hidden_size)
        self.layers = nn.ModuleList(MoshiDecoderLayer(cfg, rotary)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds: Tensor, positions: Tensor, mask: Tensor, cache: KVCache) -> Tensor:
        h = embeds
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, positions, mask, layer_cache)
        return self.norm(h)


class MoshiForCausalLM(nn.Module):
    def __init__(self, cfg: MoshiConfig) -> None:
        super().__init__()
        self.model = MoshiModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    def new_cache(self) -> KVCache:
        return [[] for _ in self.model.layers]
