"""BAGEL's language model: Qwen2 (q/k/v bias, per-head q/k RMSNorm) whose every layer holds two
experts, one for understanding (text, ViT tokens) and one for generation (VAE latent tokens):
separate q/k/v/o projections, q/k norms, layer norms and MLPs, one attention over the whole
sequence and one KV cache.

    rows of one forward:   | und rows (text, markers, ViT) | gen rows (latent tokens) |
    per layer:  norm_e -> q/k/v_e -> q/k norm_e -> rotary -> attention over [cache | new]
                -> o_e -> + residual -> norm_e -> mlp_e -> + residual      (e: the row's expert)

Names follow the upstream checkpoint (`language_model.model.layers.N.self_attn.q_proj_moe_gen`),
so ema.safetensors loads by name. Attention reads a request's cache (`KVContext`): a prefix
of earlier segments, which new rows see whole; `causal` rows also see each other causally, else
all new rows see each other (an image's tokens, the latent tokens of a flow step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.norm import RMSNorm
from omnistage.layers.rotary import RotaryEmbedding, get_rope
from omnistage.models.bagel.config import BagelLLMConfig


@dataclass(slots=True)
class KVContext:
    """One request's cache: per layer K and V (S, Hkv, D), the next rotary position."""
    keys: list[Tensor | None] = field(default_factory=list)
    values: list[Tensor | None] = field(default_factory=list)
    num_tokens: int = 0
    rope: int = 0

    @classmethod
    def empty(cls, num_layers: int) -> KVContext:
        return cls([None] * num_layers, [None] * num_layers)

    def copy(self) -> KVContext:
        """A branch of this context (tensors are never written in place, so sharing is safe)."""
        return KVContext(list(self.keys), list(self.values), self.num_tokens, self.rope)


@dataclass(frozen=True, slots=True)
class Rows:
    """Which rows of a forward go to which expert; gen None: all rows are understanding."""
    und: Tensor | None = None      # (Tu,) int64
    gen: Tensor | None = None      # (Tg,) int64

    def apply(self, x: Tensor, f_und: nn.Module, f_gen: nn.Module, width: int) -> Tensor:
        """(T, ...) -> (T, width): each row through its expert's module."""
        if self.gen is None:
            return f_und(x)
        out = x.new_empty((x.shape[0], width, *x.shape[2:]))
        out[self.und] = f_und(x[self.und])
        out[self.gen] = f_gen(x[self.gen])
        return out


class MoTAttention(nn.Module):
    def __init__(self, cfg: BagelLLMConfig, layer_idx: int) -> None:
        super().__init__()
        d, h, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.layer_idx, self.head_dim, self.num_heads, self.num_kv_heads = layer_idx, d, h, hkv
        for sfx in ("", "_moe_gen"):
            setattr(self, "q_proj" + sfx, nn.Linear(cfg.hidden_size, h * d, bias=True))
            setattr(self, "k_proj" + sfx, nn.Linear(cfg.hidden_size, hkv * d, bias=True))
            setattr(self, "v_proj" + sfx, nn.Linear(cfg.hidden_size, hkv * d, bias=True))
            setattr(self, "o_proj" + sfx, nn.Linear(h * d, cfg.hidden_size, bias=False))
            setattr(self, "q_norm" + sfx, RMSNorm(d, eps=cfg.rms_norm_eps))
            setattr(self, "k_norm" + sfx, RMSNorm(d, eps=cfg.rms_norm_eps))

    def forward(self, x: Tensor, positions: Tensor, rope: RotaryEmbedding, rows: Rows,
                ctx: KVContext, causal: bool, store: bool) -> Tensor:
        """x (T, hidden) -> (T, hidden); with `store` the new K/V join `ctx`."""
        d, h, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        q = rows.apply(x, self.q_proj, self.q_proj_moe_gen, h * d).view(-1, h, d)
        k = rows.apply(x, self.k_proj, self.k_proj_moe_gen, hkv * d).view(-1, hkv, d)
        v = rows.apply(x, self.v_proj, self.v_proj_moe_gen, hkv * d).view(-1, hkv, d)
        q = rows.apply(q, self.q_norm, self.q_norm_moe_gen, h)
        k = rows.apply(k, self.k_norm, self.k_norm_moe_gen, hkv)
        q, k = rope(positions, q, k)
        past_k, past_v = ctx.keys[self.layer_idx], ctx.values[self.layer_idx]
        all_k = k if past_k is None else torch.cat([past_k, k])             # (S + T, Hkv, D)
        all_v = v if past_v is None else torch.cat([past_v, v])
        if store:
            ctx.keys[self.layer_idx], ctx.values[self.layer_idx] = all_k, all_v
        out = attend(q, all_k, all_v, causal)                               # (T, H, D)
        return rows.apply(out.flatten(1), self.o_proj, self.o_proj_moe_gen, x.shape[1])


def attend(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """q (T, H, D) over k/v (S, Hkv, D), S >= T, the last T keys being q's own rows; causal:
    row j sees keys up to S - T + j (flash-attn's bottom-right alignment)."""
    t, s = q.shape[0], k.shape[0]
    mask = None
    if causal and t > 1:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)     # (H, T, D)
    if q.is_cuda:   # the fused kernels take 4-D inputs only: 3-D runs the math kernel there
        q, k, v = q[None], k[None], v[None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                         enable_gqa=q.shape[-3] != k.shape[-3])
    return (out[0] if out.dim() == 4 else out).transpose(0, 1)


class Qwen2MLP(nn.Module):
    def __init__(self, cfg: BagelLLMConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2MoTDecoderLayer(nn.Module):
    def __init__(self, cfg: BagelLLMConfig, layer_idx: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = MoTAttention(cfg, layer_idx)
        self.mlp, self.mlp_moe_gen = Qwen2MLP(cfg), Qwen2MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.input_layernorm_moe_gen = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm_moe_gen = RMSNorm(cfg.hidden_size, eps)

    def forward(self, x: Tensor, positions: Tensor, rope: RotaryEmbedding, rows: Rows,
                ctx: KVContext, causal: bool, store: bool) -> Tensor:
        hd = x.shape[1]
        h = rows.apply(x, self.input_layernorm, self.input_layernorm_moe_gen, hd)
        x = x + self.self_attn(h, positions, rope, rows, ctx, causal, store)
        h = rows.apply(x, self.post_attention_layernorm, self.post_attention_layernorm_moe_gen,
                       hd)
        return x + rows.apply(h, self.mlp, self.mlp_moe_gen, hd)


class Qwen2MoTModel(nn.Module):
    def __init__(self, cfg: BagelLLMConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2MoTDecoderLayer(cfg, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_moe_gen = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = get_rope(cfg.head_dim, cfg.max_position_embeddings,
                                   {"rope_type": "default", "rope_theta": cfg.rope_theta})

    def forward(self, x: Tensor, positions: Tensor, rows: Rows, ctx: KVContext, causal: bool,
                store: bool) -> Tensor:
        """x (T, hidden) embedded rows -> final-normed hidden states (T, hidden)."""
        for layer in self.layers:
            x = layer(x, positions, self.rotary_emb, rows, ctx, causal, store)
        if store:
            ctx.num_tokens += x.shape[0]
        return rows.apply(x, self.norm, self.norm_moe_gen, x.shape[1])


class BagelLanguageModel(nn.Module):
    """`language_model.*` of the checkpoint: the MoT model and its LM head."""

    def __init__(self, cfg: BagelLLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Qwen2MoTModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
