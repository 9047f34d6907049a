"""Rotary position embedding (neox / rotate-half layout, as Qwen and Llama use).

cos/sin are precomputed in float32 for every position up to max_position; a forward pass gathers
the rows for `positions` (T,) and rotates q (T, H, D) and k (T, Hkv, D):

    x * cos + rotate_half(x) * sin,   rotate_half(| x1 | x2 |) = | -x2 | x1 |

The inverse frequencies and the attention scaling of scaled variants (linear, yarn, llama3,
longrope, ...) come from transformers' own ROPE_INIT_FUNCTIONS, so they match HF exactly.

`norm_and_rotate` is what attention layers call (through `Attention.rotate_and_attend`): the
optional per-head q/k RMSNorm (Qwen3) and the rotation, done by one Triton kernel on CUDA for
this table (fused.py), reading the cos/sin rows by position itself; with the Triton attention
backend that kernel also writes k and v into the KV cache. Other rotary modules (M-RoPE) take
the unfused path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from omnistage.layers import fused
from omnistage.layers.norm import RMSNorm


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, cos: Tensor, sin: Tensor) -> None:
        super().__init__()
        assert cos.shape == sin.shape and cos.shape[1] == head_dim, (cos.shape, head_dim)
        self.head_dim = head_dim
        self.register_buffer("cos_cache", cos, persistent=False)   # (max_position, D) float32
        self.register_buffer("sin_cache", sin, persistent=False)
        self._rows: tuple[Tensor, torch.dtype, Tensor, Tensor] | None = None

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        # Every layer shares this module and the step's `positions`: gather the rows once.
        key = (positions, q.dtype)
        if self._rows is None or self._rows[0] is not positions or self._rows[1] != q.dtype:
            cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)   # (T, 1, D)
            sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
            self._rows = (*key, cos, sin)
        cos, sin = self._rows[2], self._rows[3]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k

    def fused_tables(self, positions: Tensor) -> tuple[Tensor, Tensor, None] | None:
        """What the fused kernels rotate with: (cos, sin) tables (P, D), no axis map; for
        1-D positions only."""
        return (self.cos_cache, self.sin_cache, None) if positions.dim() == 1 else None

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.cos_cache.shape[0]}"


def fused_rope_args(rotary: nn.Module, positions: Tensor, q: Tensor, q_norm: RMSNorm | None,
                    k_norm: RMSNorm | None) -> tuple | None:
    """(q weight, k weight, eps, cos, sin, positions, axis) for the fused q/k norm + rotary
    kernels of triton_ops, where they apply (CUDA, and a rotary module whose `fused_tables`
    takes these positions); else None."""
    if (fused.ops_for(q) is None or (q_norm is None) != (k_norm is None)
            or (q_norm is not None and q_norm.eps != k_norm.eps)):  # type: ignore[union-attr]
        return None
    tables = getattr(rotary, "fused_tables", lambda _: None)(positions)
    if tables is None:
        return None
    return (None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,  # type: ignore[union-attr]
            1e-6 if q_norm is None else q_norm.eps, *tables[:2], positions, tables[2])


def norm_and_rotate(rotary: nn.Module, positions: Tensor, q: Tensor, k: Tensor,
                    q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None
                    ) -> tuple[Tensor, Tensor]:
    """q (T, H, D), k (T, Hkv, D): RMSNorm over each head (if given), then `rotary`."""
    args = fused_rope_args(rotary, positions, q, q_norm, k_norm)
    if args is not None:
        return fused.ops_for(q).qk_norm_rope(q, k, *args)  # type: ignore[union-attr]
    if q_norm is not None and k_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return rotary(positions, q, k)


def _cos_sin(inv_freq: Tensor, positions: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]   # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)                          # (P, D)
    return emb.cos() * scaling, emb.sin() * scaling


def get_rope(head_dim: int, max_position: int, rope_parameters: dict[str, Any]) -> RotaryEmbedding:
    """Build the rotary table. `rope_parameters` is HF's dict: {"rope_type", "rope_theta", ...}."""
    rope_type = rope_parameters.get("rope_type", "default")
    positions = torch.arange(max_position)
    if rope_type == "default":
        theta = rope_parameters["rope_theta"]
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        cos, sin = _cos_sin(inv_freq, positions, 1.0)
        return RotaryEmbedding(head_dim, cos, sin)
    if rope_type == "dynamic":
        raise NotImplementedError(
            "rope_type 'dynamic' (dynamic NTK scaling) changes the frequencies with the sequence "
            "length and cannot use a precomputed cache; it is not supported")
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {rope_type!r}: unknown (known: default, "
                         f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))})")

    # The HF init functions read a config; give them one that holds only what they need.
    # hidden_size / num_attention_heads are read (eagerly) as a fallback for head_dim.
    hf_config = PretrainedConfig(head_dim=head_dim, hidden_size=head_dim, num_attention_heads=1,
                                 max_position_embeddings=max_position,
                                 rope_parameters=dict(rope_parameters))
    init_fn = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = init_fn(hf_config, None)
    if inv_freq.numel() * 2 != head_dim:
        raise NotImplementedError(
            f"rope_parameters {rope_parameters}: rotary dim {inv_freq.numel() * 2} != head_dim "
            f"{head_dim} (partial rotary embedding is not supported)")
    cos, sin = _cos_sin(inv_freq, positions, scaling)
    if rope_type == "longrope":
        # Positions past the pretraining window use the long factors. (HF switches the whole
        # sequence once it grows past the window; with a KV cache, earlier keys keep theirs.)
        original = rope_parameters["original_max_position_embeddings"]
        if max_position > original:
            long_inv_freq, _ = init_fn(hf_config, None, max_position)
            cos_long, sin_long = _cos_sin(long_inv_freq, positions, scaling)
            cos[original:], sin[original:] = cos_long[original:], sin_long[original:]
    return RotaryEmbedding(head_dim, cos, sin)
