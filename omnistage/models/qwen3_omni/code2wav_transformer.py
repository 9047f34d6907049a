"""Qwen3-Omni code2wav's pre-transformer: sliding-window causal attention + SwiGLU with
layer-scaled residuals, whole (`forward`) or continued from kept keys and values
(`forward_cached`, what a stream uses). Module names follow the checkpoint's
`code2wav.pre_transformer.*` tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.linear import Linear, MergedLinear, QKVLinear
from omnistage.layers.norm import RMSNorm
from omnistage.layers.rotary import RotaryEmbedding, get_rope, rotate_half
from omnistage.models.qwen3_omni.code2wav_config import Code2WavConfig


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class Code2WavAttention(nn.Module):
    def __init__(self, cfg: Code2WavConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.qkv_sizes = [self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2]
        self.qkv_proj = QKVLinear(cfg.hidden_size, self.head_dim, self.num_heads,
                                  self.num_kv_heads, bias=cfg.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size,
                             bias=cfg.attention_bias)
        self.rotary = rotary

    def forward(self, positions: Tensor, x: Tensor, mask: Tensor) -> Tensor:
        B, T, _ = x.shape                                         # x: (B, T, hidden)
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim)           # (B, T, H, D)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)        # (B, T, Hkv, D)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            enable_gqa=self.num_kv_heads != self.num_heads)       # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def forward_cached(self, x: Tensor, past_k: Tensor, past_v: Tensor, q_pos: Tensor,
                       k_pos: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """New rows x (B, N, hidden) after P cached ones (past_k / past_v (B, P, Hkv, D), not
        rotated): -> out (B, N, hidden), and the keys / values of all P + N rows, unrotated,
        for the next call's cache. Rotation uses positions relative to the cache's start,
        which only relative offsets reach."""
        B, N, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = q.view(B, N, self.num_heads, self.head_dim)           # (B, N, H, D)
        k_all = torch.cat([past_k, k.view(B, N, self.num_kv_heads, self.head_dim)], 1)
        v_all = torch.cat([past_v, v.view(B, N, self.num_kv_heads, self.head_dim)], 1)
        out = F.scaled_dot_product_attention(
            _rotate(self.rotary, q, q_pos).transpose(1, 2),
            _rotate(self.rotary, k_all, k_pos).transpose(1, 2), v_all.transpose(1, 2),
            attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)   # (B, H, N, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, N, -1)), k_all, v_all


def _rotate(rotary: RotaryEmbedding, x: Tensor, positions: Tensor) -> Tensor:
    """x (B, T, heads, D) rotated for `positions` (T,), as `RotaryEmbedding.forward` does."""
    cos = rotary.cos_cache[positions].unsqueeze(1).to(x.dtype)   # (T, 1, D)
    sin = rotary.sin_cache[positions].unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Code2WavMLP(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)          # (B, T, I) each
        return self.down_proj(F.silu(gate) * up)


class Code2WavTransformerLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Code2WavAttention(cfg, rotary)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = Code2WavMLP(cfg)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(self, positions: Tensor, h: Tensor, mask: Tensor) -> Tensor:
        h = h + self.self_attn_layer_scale(self.self_attn(positions, self.input_layernorm(h), mask))
        return h + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(h)))

    def forward_cached(self, h: Tensor, past_k: Tensor, past_v: Tensor, q_pos: Tensor,
                       k_pos: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        attn, k_all, v_all = self.self_attn.forward_cached(
            self.input_layernorm(h), past_k, past_v, q_pos, k_pos, mask)
        h = h + self.self_attn_layer_scale(attn)
        return h + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(h))), k_all, v_all


class Code2WavTransformer(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.sliding_window = cfg.sliding_window
        rotary = get_rope(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_parameters)
        self.layers = nn.ModuleList(Code2WavTransformerLayer(cfg, rotary)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, h: Tensor) -> Tensor:                       # (B, T, hidden)
        T = h.shape[1]
        positions = torch.arange(T, device=h.device)              # every window starts at 0
        offset = positions[:, None] - positions[None, :]          # (T, T): query - key
        mask = (offset >= 0) & (offset < self.sliding_window)     # causal, `window` keys wide
        for layer in self.layers:
            h = layer(positions, h, mask)
        return self.norm(h)

    @property
    def num_cached(self) -> int:
        """Rows of keys / values a stream keeps: all a new row's window reaches back."""
        return self.sliding_window - 1

    def forward_cached(self, h: Tensor, past: Tensor, num_past: Tensor, num_new: Tensor
                       ) -> tuple[Tensor, Tensor]:
        """Streams continued: new rows h (B, N, hidden), right-padded (num_new (B,) real),
        after each stream's cache `past` (B, layers, 2, P, Hkv, D) whose last num_past (B,)
        rows are real (P = num_cached). Every layer sees exactly the keys the whole decode
        would, so the rows equal the whole decode's. -> (B, N, hidden) normed, and the new
        caches (the last P real rows of each stream, right-aligned as `past`).

            key slots   | cache: P rows (the last num_past real) | new: N rows (num_new real) |
            query j     at slot P + j: sees slots j .. P + j that are real
        """
        B, N, _ = h.shape
        P, dev = self.num_cached, h.device
        slots = torch.arange(P + N, device=dev)
        q_idx = torch.arange(N, device=dev)
        mask = (slots[None, :] <= P + q_idx[:, None]) & (slots[None, :] >= q_idx[:, None])
        real = (slots[None, :] >= P) | (slots[None, :] >= P - num_past[:, None])   # (B, P + N)
        mask = (mask[None] & real[:, None])[:, None]               # (B, 1, N, P + N)
        keep = (num_new[:, None] + torch.arange(P, device=dev)[None])   # (B, P): last P real
        keep = keep[:, :, None, None]
        caches = []
        for i, layer in enumerate(self.layers):
            h, k_all, v_all = layer.forward_cached(h, past[:, i, 0], past[:, i, 1],
                                                   slots[P:], slots, mask)
            idx = keep.expand(-1, -1, *k_all.shape[2:])
            caches.append(torch.stack([k_all.gather(1, idx), v_all.gather(1, idx)], 1))
        return self.norm(h), torch.stack(caches, 1)
