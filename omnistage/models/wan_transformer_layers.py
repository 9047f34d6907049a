"""The Wan transformer's parts below the model (wan_transformer.py has the picture): float32
norms, the across-heads RMSNorm (tensor-parallel), the 3D rope table, the condition
embeddings with the per-value timestep embedding (`TimeEmbedding`), attention and the block.
Names follow diffusers' `transformer_wan.py` so checkpoint keys map one-to-one."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.dit import (FeedForward, TimestepEmbedding, apply_rope, gated_add,
                                  norm_modulate, timestep_embedding)
from omnistage.layers.linear import copy_checked
from omnistage.layers.parallel import (ColumnParallelLinear, RowParallelLinear, all_reduce,
                                       divide, tp_group)
from omnistage.layers.sequence_parallel import SequenceSplit, sdpa
from omnistage.models.wan_transformer_config import WanTransformerConfig

Rope = tuple[Tensor, Tensor]     # cos, sin: (N, hd/2) float32, one angle per pair of features


# ---- norms, rope ---------------------------------------------------------------------------

class FP32LayerNorm(nn.LayerNorm):
    """diffusers' FP32LayerNorm: statistics and affine in float32, the result in x's dtype."""

    def forward(self, x: Tensor) -> Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


class HeadsRMSNorm(nn.Module):
    """RMSNorm over the features of all heads (torch.nn.RMSNorm(heads * hd)) while this rank
    holds only its heads' slice: the squares are summed over the tensor-parallel ranks, and
    the weight is split like the column-parallel projection before it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.tp, self.dim, self.eps = tp_group(), dim, eps
        self.local = divide(dim, self.tp.world_size, "RMSNorm features")
        self.weight = nn.Parameter(torch.ones(self.local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: Tensor) -> None:
        if tuple(loaded_weight.shape) != (self.dim,):
            raise ValueError(f"expected shape {(self.dim,)}, got {tuple(loaded_weight.shape)}")
        copy_checked(param.data, loaded_weight.narrow(0, self.tp.rank * self.local, self.local))

    def forward(self, x: Tensor) -> Tensor:                      # x: (..., dim / tp)
        if self.tp.world_size == 1:        # one kernel, diffusers' own (its nn.RMSNorm)
            return F.rms_norm(x, (self.dim,), self.weight, self.eps)
        squares = all_reduce(x.float().pow(2).sum(-1, keepdim=True), self.tp)
        return (x.float() * torch.rsqrt(squares / self.dim + self.eps)).to(x.dtype) * self.weight


def wan_rope(grid: tuple[int, int, int], head_dim: int, max_len: int, device: torch.device
             ) -> Rope:
    """diffusers' WanRotaryPosEmbed for an F' x H' x W' token grid: the head's pairs split
    into frame, height and width parts (h = w = 2 * (hd // 6), the frame the rest), each
    rotated by its axis' position from 0; angles in float64 as diffusers'. Made on the device
    by each forward (a few small kernels): a CUDA graph of the forward then holds its own
    tables, where a cache shared by the graphs could free them under a graph."""
    if max(grid) > max_len:
        raise ValueError(f"token grid {grid} exceeds rope_max_seq_len {max_len}")
    hw_dim = 2 * (head_dim // 6)
    f, h, w = grid
    axes = []
    for n, dim in zip(grid, (head_dim - 2 * hw_dim, hw_dim, hw_dim)):
        exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim
        positions = torch.arange(n, dtype=torch.float64, device=device)
        axes.append(torch.outer(positions, 1.0 / 10000.0 ** exponents))        # (n, dim/2)
    angles = torch.cat([axes[0][:, None, None].expand(f, h, w, -1),
                        axes[1][None, :, None].expand(f, h, w, -1),
                        axes[2][None, None, :].expand(f, h, w, -1)], dim=-1)   # (F', H', W', hd/2)
    angles = angles.reshape(f * h * w, -1)
    return angles.cos().float(), angles.sin().float()


# ---- embeddings ----------------------------------------------------------------------------

class WanImageEmbedding(nn.Module):
    """CLIP vision tokens -> model width: LayerNorm, GELU MLP (exact GELU), LayerNorm."""

    def __init__(self, in_features: int, out_features: int, pos_embed_seq_len: int | None
                 ) -> None:
        super().__init__()
        self.norm1 = FP32LayerNorm(in_features)
        self.ff = FeedForward(in_features, mult=1, dim_out=out_features, activation="gelu")
        self.norm2 = FP32LayerNorm(out_features)
        self.pos_embed = (nn.Parameter(torch.zeros(1, pos_embed_seq_len, in_features))
                          if pos_embed_seq_len else None)

    def forward(self, image: Tensor) -> Tensor:
        if self.pos_embed is not None:   # FLF2V: pairs of rows (first, last frame) become one
            image = image.view(-1, 2 * image.shape[1], image.shape[2]) + self.pos_embed
        return self.norm2(self.ff(self.norm1(image)))


@dataclass(frozen=True, slots=True)
class TimeEmbedding:
    """The batch's time conditioning for the U distinct timestep values: temb (U, D), proj
    (U, 6, D) the blocks' modulation input; index (B, S): the value each row (S = 1) or each
    of its tokens uses (per-token timesteps: finding the values costs a host sync)."""
    temb: Tensor
    proj: Tensor
    index: Tensor

    def rows(self, idx: Tensor) -> TimeEmbedding:
        return replace(self, index=self.index[idx])

    def pick(self, values: Tensor) -> Tensor:
        """values (U, D) -> (B, S, D): each row's / token's."""
        return values[self.index]


class WanTimeTextImageEmbedding(nn.Module):
    def __init__(self, cfg: WanTransformerConfig) -> None:
        super().__init__()
        dim = cfg.inner_dim
        self.freq_dim = cfg.freq_dim
        self.time_embedder = TimestepEmbedding(cfg.freq_dim, dim)
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = TimestepEmbedding(cfg.text_dim, dim, gelu_tanh=True)
        self.image_embedder = (WanImageEmbedding(cfg.image_dim, dim, cfg.pos_embed_seq_len)
                               if cfg.image_dim else None)

    def time(self, timestep: Tensor, dtype: torch.dtype) -> TimeEmbedding:
        """timestep (B, S): S = 1, or one per (local) token."""
        if timestep.shape[1] == 1:            # a row's own: no search, no host sync
            values = timestep[:, 0]
            index = torch.arange(len(values), device=timestep.device)[:, None]
        else:
            values, index = torch.unique(timestep, return_inverse=True)          # (U,), (B, S)
        sinusoid = timestep_embedding(values, self.freq_dim)                     # (U, freq)
        temb = self.time_embedder(sinusoid.to(self.time_embedder.linear_1.weight.dtype))
        temb = temb.to(dtype)                                                    # (U, D)
        return TimeEmbedding(temb, self.time_proj(F.silu(temb)).unflatten(-1, (6, -1)), index)


# ---- attention and block -------------------------------------------------------------------

class WanAttention(nn.Module):
    """Self-attention (rope; every video token through `seq`) or cross-attention (the text,
    and the CLIP image tokens where the checkpoint has add_k_proj). H: this rank's heads."""

    def __init__(self, dim: int, num_heads: int, eps: float,
                 added_kv_proj_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = dim // num_heads

        def column(in_features: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(in_features, dim, bias=True)

        self.to_q, self.to_k, self.to_v = column(dim), column(dim), column(dim)
        self.to_out = nn.ModuleList([RowParallelLinear(dim, dim, bias=True), nn.Identity()])
        self.norm_q, self.norm_k = HeadsRMSNorm(dim, eps), HeadsRMSNorm(dim, eps)
        if added_kv_proj_dim is not None:
            self.add_k_proj, self.add_v_proj = column(added_kv_proj_dim), column(added_kv_proj_dim)
            self.norm_added_k = HeadsRMSNorm(dim, eps)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (-1, self.head_dim))                            # (B, S, H, hd)

    def self_attention(self, x: Tensor, seq: SequenceSplit, rope: Rope) -> Tensor:
        """x (B, N, D): this rank's video tokens; rope sliced alike."""
        q = apply_rope(self._heads(self.norm_q(self.to_q(x))), *rope)
        k = apply_rope(self._heads(self.norm_k(self.to_k(x))), *rope)
        out = seq.attend(q, k, self._heads(self.to_v(x)))                      # (B, N, H, hd)
        return self.to_out[0](out.flatten(2).type_as(q))

    def cross_attention(self, x: Tensor, text: Tensor, image: Tensor | None) -> Tensor:
        """x (B, N, D) queries; text (B, L, D) and image (B, I, D) keys: two softmaxes, added."""
        q = self._heads(self.norm_q(self.to_q(x)))
        out = sdpa(q, self._heads(self.norm_k(self.to_k(text))), self._heads(self.to_v(text)),
                   None)
        if image is not None:
            k_img = self._heads(self.norm_added_k(self.add_k_proj(image)))
            out = out + sdpa(q, k_img, self._heads(self.add_v_proj(image)), None)
        return self.to_out[0](out.flatten(2).type_as(q))


class WanTransformerBlock(nn.Module):
    def __init__(self, cfg: WanTransformerConfig) -> None:
        super().__init__()
        dim, heads, eps = cfg.inner_dim, cfg.num_attention_heads, cfg.eps
        self.norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.attn1 = WanAttention(dim, heads, eps)
        self.attn2 = WanAttention(dim, heads, eps, cfg.added_kv_proj_dim)
        self.norm2 = (FP32LayerNorm(dim, eps, elementwise_affine=True) if cfg.cross_attn_norm
                      else nn.Identity())
        self.ffn = FeedForward(dim, inner_dim=cfg.ffn_dim)
        self.norm3 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.empty(1, 6, dim))

    def modulation(self, time: TimeEmbedding) -> Callable[[int], Tensor]:
        """i -> shift, scale, gate, c_shift, c_scale, c_gate (i = 0..5) per row / token:
        (B, S, D) float32, picked when used (one per token would be 6 x the stream)."""
        table = self.scale_shift_table[0] + time.proj.float()                    # (U, 6, D)
        return lambda i: time.pick(table[:, i])

    def modulated_input(self, x: Tensor, time: TimeEmbedding,
                        mod: Callable[[int], Tensor] | None = None) -> Tensor:
        """What self-attention sees: norm1(x) * (1 + scale) + shift."""
        mod = mod or self.modulation(time)
        return norm_modulate(self.norm1, x, mod(1), mod(0))

    def forward(self, x: Tensor, text: Tensor, image: Tensor | None, time: TimeEmbedding,
                rope: Rope, seq: SequenceSplit) -> Tensor:
        """diffusers' float32 norms, modulation and gated residuals, rounded once each."""
        mod = self.modulation(time)
        h = self.modulated_input(x, time, mod)
        x = gated_add(x, self.attn1.self_attention(h, seq, rope), mod(2))
        x = x + self.attn2.cross_attention(norm_modulate(self.norm2, x), text, image)
        return gated_add(x, self.ffn(norm_modulate(self.norm3, x, mod(4), mod(3))), mod(5))
