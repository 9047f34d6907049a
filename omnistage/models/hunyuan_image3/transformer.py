"""HunyuanImage-3.0's decoder stack: GQA attention with 2D rotary positions and q/k RMSNorm after
the rotation, then a mixture of experts (top-k softmax routing over SwiGLU experts, plus a shared
SwiGLU MLP). Pre-norm residual blocks; no final norm on the image path (ln_f feeds the LM head).

    qkv_proj rows, per kv head: | q (G heads) | k | v |    G = heads / kv heads
    rope: positions (y, x) per token; frequency pair m rotates by (y th_2m, x th_2m+1), the
          half-split rotation of HF's rotate_half; text tokens have y = x = their index
    moe:  p = softmax(x Wg^T) in float32; top-k; renormalised when norm_topk_prob and k > 1,
          else scaled by routed_scaling_factor; y = sum_k p_k E_k(x) + shared(x)
    gate_and_up_proj rows of a checkpoint's expert: | up | gate |  (down(x1 * silu(x2)))

Tensor parallelism: rank r keeps kv heads r*Hkv/R.. (each with its q heads: a contiguous block
of qkv_proj's rows), the matching columns of o_proj, and an I/R slice of every expert and of the
shared MLP (qwen3_omni's FusedExperts); the router is whole on every rank. Two all-reduces a
layer, as the other TP models here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.norm import RMSNorm
from omnistage.layers.parallel import (ColumnParallelLinear, MergedColumnParallelLinear,
                                       RowParallelLinear, all_reduce, divide, tp_group)
from omnistage.models.hunyuan_image3.config import HunyuanImage3Config
from omnistage.models.qwen3_omni.moe import FusedExperts
from omnistage.layers.activation import SiluAndMul


def rope_cos_sin(pos: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """pos (B, S, 2) integer (y, x) -> cos, sin (B, S, head_dim)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    inv = inv.to(pos.device).reshape(head_dim // 4, 2)                  # (D/4, [y, x])
    ang = (pos.float()[:, :, None, :] * inv).flatten(2)                 # (B, S, D/2)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:     # x (B, h, S, D); cos (B, S, D)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        tp = tp_group()
        self.head_dim = cfg.head_dim
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.kv_heads = divide(cfg.num_key_value_heads, tp.world_size, "key/value heads")
        rows = cfg.num_key_value_heads * (self.groups + 2) * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, rows)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size)
        self.use_qk_norm = cfg.use_qk_norm
        if cfg.use_qk_norm:
            self.query_layernorm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.key_layernorm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, S, H) -> q (B, h, S, D), k, v (B, h_kv, S, D), rotated and normed."""
        b, s, _ = x.shape
        qkv = self.qkv_proj(x).reshape(b, s, self.kv_heads, self.groups + 2, self.head_dim)
        q = qkv[:, :, :, :self.groups].reshape(b, s, -1, self.head_dim).transpose(1, 2)
        k = qkv[:, :, :, self.groups].transpose(1, 2)
        v = qkv[:, :, :, self.groups + 1].transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        return q.to(v.dtype), k.to(v.dtype), v          # rope ran in float32, as upstream

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """mask (B, 1, S, P + S) bool over [past keys, these keys]; returns the output and this
        call's keys and values (for a later call's `past`)."""
        q, k, v = self.qkv(x, cos, sin)
        kk, vv = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        return self.o_proj(out), (k, v)


class MoE(nn.Module):
    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        self.tp = tp_group()
        self.top_k, self.norm_topk = cfg.moe_topk, cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor
        self.gate = nn.Module()
        self.gate.wg = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_mlp = None
        if cfg.shared_intermediate_size:
            inter = cfg.shared_intermediate_size
            self.shared_mlp = nn.Module()
            self.shared_mlp.gate_and_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter] * 2)
            self.shared_mlp.down_proj = RowParallelLinear(inter, cfg.hidden_size, reduce_results=False)
        self.act = SiluAndMul()

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        probs = torch.softmax(F.linear(x.float(), self.gate.wg.weight.float()), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk and self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).eps)
        else:
            weights = weights * self.scale
        return ids, weights.to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:                             # (B, S, H)
        flat = x.reshape(-1, x.shape[-1])
        ids, weights = self.route(flat)
        y = self.experts(flat, ids, weights)
        if self.shared_mlp is not None:
            m = self.shared_mlp
            y = y + m.down_proj(self.act(m.gate_and_up_proj(flat)))
        return all_reduce(y, self.tp).reshape(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg)

    def forward(self, x, cos, sin, mask, past):
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Backbone(nn.Module):
    """`model.*` of the checkpoint: wte, layers, ln_f."""

    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.ln_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: list[tuple[Tensor, Tensor]] | None = None
                ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """x (B, S, H) embeddings -> last layer's hidden states (no ln_f) and each layer's
        keys/values of these S tokens."""
        kvs = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, mask, None if past is None else past[i])
            kvs.append(kv)
        return x, kvs
