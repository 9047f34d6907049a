"""Blocks that diffusion transformers share, with diffusers' parameter names so checkpoints
load one-to-one: sinusoidal timestep embedding, its MLP, adaptive LayerNorms, the GELU / SiLU MLP,
the rotation of interleaved feature pairs by complex rope tables.

The elementwise chains of a block (Wan, Qwen-Image, FLUX) go through the fused Triton kernels
of triton_ops.py where they run (fused.ops_for: CUDA tensors, outside torch.compile, whose own
fusion does the same), else through the PyTorch ops diffusers runs:

    norm_modulate     a norm module's LayerNorm [* (1 + scale) + shift], in float32 (Wan)
    adaln_modulate    LayerNorm(x) * (1 + scale) + shift, in x's dtype (AdaLN-Zero: FLUX,
                      Qwen-Image, SD3); the kernel computes in float32 and rounds once
    gated_add         the gated residual x + y * gate
    apply_rope        interleaved pairs rotated by cos / sin tables (strided views welcome)
    norm_rope         a per-head RMSNorm (q/k norm), then apply_rope

The kernels take no host sync, so a CUDA graph captures them like the PyTorch ops.

Under tensor parallelism (layers/parallel.py) the MLP splits column / row, and the adaptive
norms' large modulation projections split by output, gathered whole (every rank holds the
whole residual stream); with one rank they are plain linears. `MergedRowParallelLinear`
closes a block whose output projection reads several column-parallel results side by side."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers import fused
from omnistage.layers.linear import copy_checked
from omnistage.layers.parallel import (ColumnParallelLinear, RowParallelLinear, divide,
                                       tp_group)


def apply_complex_rope(x: Tensor, freqs: Tensor) -> Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... of x (B, S, H, hd) by complex freqs
    (S, hd/2): one complex multiply in float32 (x0 cos - x1 sin, x0 sin + x1 cos), in x's dtype
    out."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))     # (B, S, H, hd/2)
    return torch.view_as_real(xc * freqs.unsqueeze(1)).flatten(3).type_as(x)


def fused_ops(x: Tensor):  # type: ignore[no-untyped-def]
    """The fused Triton kernels (layers/triton_ops.py) where they run on x, outside
    torch.compile (whose own fusion of the PyTorch ops does the same); else None."""
    return None if torch.compiler.is_compiling() else fused.ops_for(x)


def norm_modulate(norm: nn.Module, x: Tensor, scale: Tensor | None = None,
                  shift: Tensor | None = None) -> Tensor:
    """norm(x) [* (1 + scale) + shift] in x's dtype, in float32 as diffusers (norm: an
    FP32LayerNorm or Identity; scale, shift (B, 1 or N, D)); one kernel on CUDA."""
    ops = fused_ops(x)
    if ops is not None and isinstance(norm, nn.LayerNorm):
        return ops.norm_modulate(x, norm.eps, norm.weight, norm.bias, scale, shift)
    h = norm(x.float())
    return (h if scale is None else torch.addcmul(shift, h, 1 + scale)).type_as(x)


def adaln_modulate(x: Tensor, scale: Tensor, shift: Tensor, eps: float = 1e-6) -> Tensor:
    """LayerNorm(x) (no affine) * (1 + scale) + shift for x (B, N, D), scale and shift
    (B, 1 or N, D): diffusers' AdaLN in x's dtype; one kernel on CUDA (float32 inside)
    where the result's dtype is x's either way."""
    ops = fused_ops(x) if x.dim() == 3 and scale.dtype == shift.dtype == x.dtype else None
    if ops is not None:
        return ops.norm_modulate(x, eps, None, None, scale, shift)
    return F.layer_norm(x, x.shape[-1:], eps=eps) * (1 + scale) + shift


def gated_add(x: Tensor, y: Tensor, gate: Tensor) -> Tensor:
    """The gated residual x + y * gate (gate (B, 1 or N, D)), in x's dtype; one kernel on CUDA
    (float32 inside, rounded once). Else a gate in x's dtype as diffusers writes it,
    x + gate * y; a float32 gate on a half stream (Wan's modulation table) through addcmul,
    which promotes the operands in it (no float32 copy of the stream in memory)."""
    ops = fused_ops(x)
    if ops is not None:
        return ops.gated_add(x, y, gate)
    if gate.dtype == x.dtype:
        return x + gate * y
    return torch.addcmul(x, y, gate).type_as(x)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... of x (B, N, H, hd) by the angles of
    cos, sin (N, hd/2) float32 (views, e.g. a complex table's .real / .imag): one kernel on
    CUDA; else eagerly one complex multiply (the fewest passes over x); compiled, the same
    products in real arithmetic, which inductor fuses into one kernel (it generates no complex
    code)."""
    ops = fused_ops(x)
    if ops is not None:
        return ops.rope_pairs(x, cos, sin)
    if not torch.compiler.is_compiling():
        return apply_complex_rope(x, torch.complex(cos, sin))
    cos, sin = cos[:, None], sin[:, None]                                  # (N, 1, hd/2)
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)                   # (B, N, H, hd/2)
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)


def norm_rope(norm: nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """apply_rope(norm(x), cos, sin) for x (B, N, H, hd) and norm an RMSNorm over each head
    (its `weight` (hd,) and `eps`): the q/k norm and rope of a DiT's attention, one kernel on
    CUDA (float32 inside, rounded once)."""
    ops = fused_ops(x)
    if ops is not None:
        return ops.rms_norm_rope_pairs(x, norm.weight, norm.eps, cos, sin)
    return apply_rope(norm(x), cos, sin)


def timestep_embedding(t: Tensor, dim: int = 256, max_period: float = 10000.0) -> Tensor:
    """Sinusoid, cos first (diffusers Timesteps(flip_sin_to_cos=True, downscale_freq_shift=0))."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device)
    freqs = torch.exp(exponent / half)                               # (half,)
    args = t[:, None].float() * freqs[None, :]                       # (B, half)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)     # (B, dim)


class TimestepEmbedding(nn.Module):
    """linear_1 -> SiLU -> linear_2; also serves as diffusers' PixArtAlphaTextProjection
    (gelu_tanh: GELU with the tanh approximation in place of SiLU, as Wan's text embedder;
    bias False: FLUX.2's bias-free embedders)."""

    def __init__(self, in_dim: int, dim: int, gelu_tanh: bool = False, bias: bool = True
                 ) -> None:
        super().__init__()
        self.gelu_tanh = gelu_tanh
        self.linear_1 = nn.Linear(in_dim, dim, bias=bias)
        self.linear_2 = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear_1(x)
        return self.linear_2(F.gelu(h, approximate="tanh") if self.gelu_tanh else F.silu(h))


class AdaLayerNormZero(nn.Module):
    """LayerNorm modulated by temb; returns the normed x and the remaining chunks (gates,
    shifts, scales) in diffusers' order. num_chunks 6 (double block) or 3 (single block)."""

    def __init__(self, dim: int, num_chunks: int = 6) -> None:
        super().__init__()
        self.num_chunks = num_chunks
        self.linear = ColumnParallelLinear(dim, num_chunks * dim, bias=True, gather_output=True)

    def forward(self, x: Tensor, temb: Tensor) -> tuple[Tensor, ...]:
        shift, scale, *rest = self.linear(F.silu(temb)).chunk(self.num_chunks, dim=1)  # (B, D) each
        return (adaln_modulate(x, scale[:, None], shift[:, None]), *rest)


class AdaLayerNormContinuous(nn.Module):
    """Output norm: note the (scale, shift) order, unlike AdaLayerNormZero's (shift, scale).
    GLM-Image's variant reads a temb already activated (`silu=False`), of its own width
    (`cond_dim`), with LayerNorm eps 1e-5; bias False: FLUX.2's."""

    def __init__(self, dim: int, cond_dim: int | None = None, silu: bool = True,
                 eps: float = 1e-6, bias: bool = True) -> None:
        super().__init__()
        self.silu, self.eps = silu, eps
        self.linear = nn.Linear(cond_dim or dim, 2 * dim, bias=bias)

    def forward(self, x: Tensor, temb: Tensor) -> Tensor:
        cond = (F.silu(temb) if self.silu else temb).to(x.dtype)
        scale, shift = self.linear(cond).chunk(2, dim=1)                                # (B, D) each
        return adaln_modulate(x, scale[:, None], shift[:, None], self.eps)


ACTIVATIONS = {"gelu-approximate": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
               "linear-silu": F.silu}


class ProjectedActivation(nn.Module):
    """A FeedForward's first layer (net.0): a column-parallel projection (this rank's slice of
    the hidden features), then the activation named as diffusers' `activation_fn`:
    "gelu-approximate" (tanh GELU), "gelu" (exact GELU) or "linear-silu" (SiLU)."""

    def __init__(self, dim_in: int, dim_out: int, activation: str = "gelu-approximate") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: supported are {sorted(ACTIVATIONS)}")
        self.activation = ACTIVATIONS[activation]
        self.proj = ColumnParallelLinear(dim_in, dim_out, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.activation(self.proj(x))


class FeedForward(nn.Module):
    """net.0.proj -> gelu -> net.2 (net.1 is diffusers' dropout: no weights); split column /
    row over the tensor-parallel ranks. Hidden width `inner_dim` (default dim * mult), output
    width `dim_out` (default dim), activation `activation` (ProjectedActivation), as diffusers'
    FeedForward arguments."""

    def __init__(self, dim: int, mult: int = 4, inner_dim: int | None = None,
                 dim_out: int | None = None, activation: str = "gelu-approximate") -> None:
        super().__init__()
        inner_dim = inner_dim or dim * mult
        self.net = nn.ModuleList([ProjectedActivation(dim, inner_dim, activation), nn.Identity(),
                                  RowParallelLinear(inner_dim, dim_out or dim, bias=True)])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class MergedRowParallelLinear(RowParallelLinear):
    """A row-parallel linear whose input is several column-parallel outputs side by side
    (FLUX's single block: proj_out over [attention | MLP]), each split over the ranks: this
    rank's input and weight columns are | piece 0's slice | piece 1's slice | ..."""

    def __init__(self, input_sizes: list[int], out_features: int, bias: bool = False) -> None:
        tp = tp_group()
        self.input_sizes = list(input_sizes)
        self.local_sizes = [divide(s, tp.world_size, f"piece of {s} input features")
                            for s in input_sizes]
        super().__init__(sum(input_sizes), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Tensor) -> None:
        whole = (self.out_features, self.in_features)
        if tuple(loaded_weight.shape) != whole:
            raise ValueError(f"expected shape {whole}, got {tuple(loaded_weight.shape)}")
        start = offset = 0
        for size, local in zip(self.input_sizes, self.local_sizes):
            copy_checked(param.data.narrow(1, offset, local),
                         loaded_weight.narrow(1, start + self.tp.rank * local, local))
            start, offset = start + size, offset + local
