"""Wan transformer: diffusers' `WanTransformer3DModel` (Wan2.1, Wan2.2) in plain PyTorch.

Module and parameter names follow diffusers, so a diffusers `transformer/` folder loads by
name (`WanTransformer3DModel.from_pretrained`); numerics follow
`diffusers/models/transformers/transformer_wan.py` op for op.

    video (B,C,F,H,W) -> patch_embedding (Conv3d, stride = patch) -> x (B,N,D), N = F'H'W'
    timestep (B,) or (B,N) -> sinusoid -> time_embedder -> temb (D) -> time_proj (6D), once per
                              distinct value, picked per row / token (TimeEmbedding)
    text (B,L,text_dim) -> text_embedder;  CLIP image (B,I,image_dim) -> image_embedder
    num_layers x WanTransformerBlock, shift/scale/gate = scale_shift_table + time_proj:
        x += gate   * self_attn(norm1(x) * (1 + scale) + shift)     3D rope, all N tokens
        x +=          cross_attn(norm2(x), text [, image])          no modulation
        x += c_gate * ffn(norm3(x) * (1 + c_scale) + c_shift)
    norm_out (shift, scale from its own table + temb) -> proj_out -> unpatchify (B,C',F,H,W)

The variants differ by config only. Wan2.1 T2V: text cross-attention. Wan2.1 I2V (`image_dim`,
`added_kv_proj_dim`): the cross-attention's queries also attend to the CLIP image tokens,
with their own keys/values and softmax, and the two results add up (FLF2V's
`pos_embed_seq_len`: first and last frame's tokens, with a learnt position table). Wan2.2
A14B: two such models, one per expert, nothing special here. Wan2.2 TI2V-5B: 48 channels and
a timestep per token (the pipeline's `expand_timesteps`: with an input image, the first
latent frame's tokens get t = 0), so the modulation is per token. Those timesteps take a
few values only (t, and 0), so the embeddings are computed once per value and each token
picks its own: diffusers embeds every token, and keeps a (B, N, 6D) modulation input alive
through all blocks.

Unlike diffusers, the image tokens stay their own argument all the way down instead of being
split off the front of the context by a hard-coded text length of 512; the text keys are
not masked (Wan's pipeline pads captions with zeros to 512 and attends to the padding).
D = num_attention_heads * attention_head_dim; the q/k RMSNorms span all heads ("across
heads"), whatever `qk_norm` says, as in diffusers.

Several ranks (issue 18), from the stage's groups current at construction:
  tensor parallel  q/k/v and the image keys/values column-parallel (this rank's heads), the
                   across-heads RMSNorms summing squares over the ranks, output projections
                   row-parallel, the FFNs column / row; the rest whole on every rank
  sequence par.    the video tokens split over the Ulysses x ring ranks (self-attention
                   through SequenceSplit.attend), rope tables and per-token timesteps sliced
                   alike; text and image tokens whole on every rank (cross-attention needs
                   no exchange); the output gathered whole. Heads must divide by ulysses x tp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers import fused
from omnistage.layers.dit import (FeedForward, TimestepEmbedding, apply_complex_rope,
                                  timestep_embedding)
from omnistage.layers.linear import copy_checked
from omnistage.layers.parallel import (ColumnParallelLinear, RowParallelLinear, all_reduce,
                                       divide, tp_group)
from omnistage.layers.sequence_parallel import SequenceRanks, SequenceSplit, check_heads, sdpa
from omnistage.layers.step_cache import CacheGroup, run_cached
from omnistage.models.diffusers_loader import (build_from_folder, config_from_dict,
                                               read_config)

# Step caching (layers/step_cache.py). Where TeaCache publishes a polynomial for the model
# (ali-vilab/TeaCache, TeaCache4Wan2.1/teacache_generate.py, its variant without
# `use_ret_steps`: the first and the last step always computed, as our state machine does), the
# indicator is what it was fitted on: the relative L1 change of the timestep embedding (`e`
# there, `temb` here), per row. Wan2.1 I2V has one per resolution (480P and 720P checkpoints
# share a config): chosen by the latent grid's tokens per frame, 720P's above the midpoint.
# Other models (Wan2.2) watch the first block's modulated input, its change used as is.
TEACACHE_T2V = {1536: (2.39676752e+03, -1.31110545e+03, 2.01331979e+02, -8.29855975e+00,
                       1.37887774e-01),                                      # T2V 1.3B
                5120: (-5784.54975374, 5449.50911966, -1811.16591783, 256.27178429,
                       -13.02252404)}                                        # T2V 14B
TEACACHE_I2V_480P = (-3.02331670e+02, 2.23948934e+02, -5.25463970e+01, 5.87348440e+00,
                     -2.01973289e-01)
TEACACHE_I2V_720P = (-114.36346466, 65.26524496, -18.82220707, 4.91518089, -0.23412683)
TOKENS_480P, TOKENS_720P = 30 * 52, 45 * 80          # per latent frame, 2x2 patches
IDENTITY = (1.0, 0.0)


Rope = tuple[Tensor, Tensor]     # cos, sin: (N, hd/2) float32, one angle per pair of features


@dataclass(frozen=True, slots=True)
class WanTransformerConfig:
    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int | None = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"   # diffusers builds the same norms for any
    eps: float = 1e-6
    image_dim: int | None = None                     # Wan2.1 I2V: CLIP vision width (1280)
    added_kv_proj_dim: int | None = None             # its image keys/values' input width
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None             # FLF2V: 2 x 257 image tokens

    def __post_init__(self) -> None:
        if len(self.patch_size) != 3:
            raise ValueError(f"patch_size must be (t, h, w), got {self.patch_size}")
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise ValueError(f"image_dim ({self.image_dim}) and added_kv_proj_dim "
                             f"({self.added_kv_proj_dim}) must be set together")
        if self.added_kv_proj_dim not in (None, self.inner_dim):   # it reads embedded tokens
            raise ValueError(f"added_kv_proj_dim ({self.added_kv_proj_dim}) must equal "
                             f"num_attention_heads * attention_head_dim ({self.inner_dim})")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, raw: dict) -> WanTransformerConfig:
        return config_from_dict(cls, raw, "Wan transformer")


def teacache_coefficients(cfg: WanTransformerConfig, grid: tuple[int, int, int]
                          ) -> tuple[float, ...] | None:
    """TeaCache's polynomial for a Wan2.1 T2V / I2V config on an F' x H' x W' token grid;
    None for the others (module comment above)."""
    shape = (cfg.inner_dim, cfg.num_layers, cfg.in_channels)
    if cfg.image_dim is None and shape in ((1536, 30, 16), (5120, 40, 16)):
        return TEACACHE_T2V[cfg.inner_dim]
    if cfg.image_dim is not None and shape == (5120, 40, 36) and not cfg.pos_embed_seq_len:
        per_frame = grid[1] * grid[2]
        return TEACACHE_I2V_720P if 2 * per_frame > TOKENS_480P + TOKENS_720P \
            else TEACACHE_I2V_480P
    return None


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


def _kernels(x: Tensor):  # type: ignore[no-untyped-def]
    """The fused Triton kernels (layers/triton_ops.py) where they run on x, outside
    torch.compile (whose own fusion of the PyTorch ops below does the same); else None."""
    return None if torch.compiler.is_compiling() else fused.ops_for(x)


def norm_modulate(norm: nn.Module, x: Tensor, scale: Tensor | None = None,
                  shift: Tensor | None = None) -> Tensor:
    """norm(x) [* (1 + scale) + shift] in x's dtype, in float32 as diffusers (norm: an
    FP32LayerNorm or Identity; scale, shift (B, 1 or N, D)); one kernel on CUDA."""
    ops = _kernels(x)
    if ops is not None and isinstance(norm, nn.LayerNorm):
        return ops.norm_modulate(x, norm.eps, norm.weight, norm.bias, scale, shift)
    h = norm(x.float())
    return (h if scale is None else torch.addcmul(shift, h, 1 + scale)).type_as(x)


def gated_add(x: Tensor, y: Tensor, gate: Tensor) -> Tensor:
    """The gated residual x + y * gate in float32, in x's dtype; one kernel on CUDA (else
    addcmul: the bf16 operands promoted in it, no float32 copy of the stream in memory)."""
    ops = _kernels(x)
    if ops is not None:
        return ops.gated_add(x, y, gate)
    return torch.addcmul(x, y, gate).type_as(x)


def apply_rope(x: Tensor, rope: Rope) -> Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... of x (B, N, H, hd) by rope (N, hd/2):
    one kernel on CUDA; else eagerly one complex multiply (the fewest passes over x);
    compiled, the same products in real arithmetic, which inductor fuses into one kernel (it
    generates no complex code)."""
    cos, sin = rope
    ops = _kernels(x)
    if ops is not None:
        return ops.rope_pairs(x, cos, sin)
    if not torch.compiler.is_compiling():
        return apply_complex_rope(x, torch.complex(cos, sin))
    cos, sin = cos[:, None], sin[:, None]                                  # (N, 1, hd/2)
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)                   # (B, N, H, hd/2)
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)


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
        q = apply_rope(self._heads(self.norm_q(self.to_q(x))), rope)
        k = apply_rope(self._heads(self.norm_k(self.to_k(x))), rope)
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


# ---- model ---------------------------------------------------------------------------------

class WanTransformer3DModel(nn.Module):
    # older diffusers saved an unused query norm for the image keys (diffusers skips it too)
    ignored_tensors = ("norm_added_q",)
    # float32 in any dtype, as diffusers' _keep_in_fp32_modules (build_from_folder reads it)
    keep_in_fp32 = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")
    # FP8 (layers/fp8.py): linears left in bf16, besides those too small: the time, text and
    # image embeddings with the modulation projection (condition_embedder), the final projection
    fp8_keep = ("condition_embedder.*", "proj_out")

    def __init__(self, cfg: WanTransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim = cfg.inner_dim
        check_heads(cfg.num_attention_heads)
        self.seq_ranks = SequenceRanks.current()
        out_channels = cfg.out_channels or cfg.in_channels
        self.patch_embedding = nn.Conv3d(cfg.in_channels, dim, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size)
        self.condition_embedder = WanTimeTextImageEmbedding(cfg)
        self.blocks = nn.ModuleList([WanTransformerBlock(cfg) for _ in range(cfg.num_layers)])
        self.norm_out = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, out_channels * math.prod(cfg.patch_size))
        self.scale_shift_table = nn.Parameter(torch.empty(1, 2, dim))
        # TeaCache's Wan2.1 polynomials apply (teacache_coefficients); a pipeline of another
        # model with a Wan2.1 config (Wan2.2 A14B's experts are 14B T2V-shaped) clears it
        self.published_teacache = True

    def forward(self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor,
                encoder_hidden_states_image: Tensor | None = None,
                step_cache: list[CacheGroup] | None = None) -> Tensor:
        """hidden_states (B, C, F, H, W) latents; timestep (B,), or (B, N) one per token
        (TI2V's expand_timesteps, N = F'H'W' in frame, row, column order); text
        (B, L, text_dim); image (B, I, image_dim) CLIP tokens, for checkpoints with
        image_dim only. Returns (B, out_channels, F, H, W).
        `step_cache`: per request and branch, skip the blocks on steps whose first modulated
        input barely moved (layers/step_cache.py); None runs every block.
        Below, N counts this rank's video tokens (all of them with one sequence-parallel rank)."""
        grid = self._grid(hidden_states.shape)
        seq = SequenceSplit.split([math.prod(grid)], [None], self.seq_ranks)
        x = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2)       # (B, N, D)
        x = seq.local(x, 0).contiguous()
        time = self.condition_embedder.time(
            self._timesteps(timestep, x.shape[0], seq), encoder_hidden_states.dtype)
        text = self.condition_embedder.text_embedder(encoder_hidden_states)     # (B, L, D)
        image = self._image_tokens(encoder_hidden_states_image)                  # (B, I, D)
        cos, sin = wan_rope(grid, self.cfg.attention_head_dim, self.cfg.rope_max_seq_len,
                            x.device)
        rope = seq.local(cos, 0, dim=0), seq.local(sin, 0, dim=0)

        def run_blocks(idx: Tensor | None) -> Tensor:
            h, t, i, p = x, text, image, time
            if idx is not None:
                h, t, p = x[idx], text[idx], time.rows(idx)
                i = None if image is None else image[idx]
            for block in self.blocks:
                h = block(h, t, i, p, rope, seq)
            return h                                                             # (b, N, D)

        if step_cache is None:
            x = run_blocks(None)
        else:
            indicator, coefficients = self._cache_indicator(x, time, grid)
            x = run_cached(x, indicator, step_cache, coefficients, run_blocks)
        shift, scale = (self.scale_shift_table + time.temb[:, None]).unbind(1)   # (U, D) each
        x = norm_modulate(self.norm_out, x, time.pick(scale), time.pick(shift))
        return self._unpatchify(seq.gather(self.proj_out(x), 0), grid)

    def _cache_indicator(self, x: Tensor, time: TimeEmbedding, grid: tuple[int, int, int]
                         ) -> tuple[Tensor, tuple[float, ...]]:
        """What step caching watches, (B, S, D), and the polynomial that rescales its change:
        TeaCache's on the timestep embedding where published, else the first block's
        modulated input as is (module comment on TEACACHE_T2V)."""
        coefficients = teacache_coefficients(self.cfg, grid) if self.published_teacache \
            else None
        if coefficients is None:
            return self.blocks[0].modulated_input(x, time), IDENTITY
        return time.pick(time.temb), coefficients

    def _grid(self, shape: torch.Size) -> tuple[int, int, int]:
        """(F', H', W'): the token grid of latents (B, C, F, H, W), which the patch divides."""
        if len(shape) != 5 or shape[1] != self.cfg.in_channels:
            raise ValueError(f"hidden_states must be (batch, {self.cfg.in_channels}, frames, "
                             f"height, width), got {tuple(shape)}")
        if any(n % p for n, p in zip(shape[2:], self.cfg.patch_size)):
            raise ValueError(f"latent frames, height, width {tuple(shape[2:])} must be "
                             f"multiples of patch_size {self.cfg.patch_size}")
        return tuple(n // p for n, p in zip(shape[2:], self.cfg.patch_size))

    @staticmethod
    def _timesteps(timestep: Tensor, batch: int, seq: SequenceSplit) -> Tensor:
        """(B,) -> (B, 1); (B, N) per token -> this rank's tokens' (B, N_local)."""
        num_tokens = sum(seq.sizes[0])
        if timestep.shape == (batch,):
            return timestep[:, None]
        if timestep.shape == (batch, num_tokens):
            return seq.local(timestep, 0)
        raise ValueError(f"timestep must be (batch,) or (batch, tokens) = ({batch},) or "
                         f"({batch}, {num_tokens}), got {tuple(timestep.shape)}")

    def _image_tokens(self, image: Tensor | None) -> Tensor | None:
        embedder = self.condition_embedder.image_embedder
        if (image is None) != (embedder is None):
            raise ValueError("encoder_hidden_states_image is required by, and only accepted "
                             "by, checkpoints with image_dim (Wan2.1 I2V / FLF2V); this one has "
                             f"image_dim {self.cfg.image_dim}")
        return None if image is None else embedder(image)

    def _unpatchify(self, out: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """(B, F'H'W', pt*ph*pw*C) -> (B, C, F'pt, H'ph, W'pw), diffusers' layout."""
        pt, ph, pw = self.cfg.patch_size
        out = out.reshape(out.shape[0], *grid, pt, ph, pw, -1)     # (B, F', H', W', pt, ph, pw, C)
        return out.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> WanTransformer3DModel:
        """Build from a diffusers folder (config.json + safetensors, maybe sharded) in `dtype`
        (None: the checkpoint's). Missing, unexpected or mis-shaped tensors raise ValueError."""
        path = Path(path)
        return build_from_folder(cls, WanTransformerConfig.from_dict(read_config(path)), path,
                                 device, dtype)
