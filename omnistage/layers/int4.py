"""4-bit weight-only linears (W4A16, issue 44) in compressed-tensors' `pack-quantized` layout,
what vLLM reads for the W4A16 releases of llm-compressor (GPTQ / AWQ-made, saved packed):

    weight_packed  (N, K / 8) int32   eight 4-bit values a word, value i at bits 4i..4i+3,
                                      stored as q + 8 (q in [-8, 7], symmetric)
    weight_scale   (N, K / G)         one scale per group of G inputs (bf16 / fp16 / fp32)
    weight_shape   [N, K]

    W[n, k] = q[n, k] * weight_scale[n, k // G]

`Int4Linear` keeps the packed words (a quarter of bf16's bytes, plus the scales). A few rows
(1 to 4: decode steps) on CUDA take the matrix-vector kernel of triton_int4.py, which reads the
words and scales and dequantizes them in registers; more rows (prefill) and the CPU dequantize
the weight on every call before one matmul in the activations' dtype (the dequantized weight a
temporary of the call). Both compute the same weight.

Asymmetric groups and activation-ordered groups (AutoAWQ / GPTQ checkpoints, layers/awq_gptq.py)
keep the same words, read as unsigned nibbles u in [0, 15] (u = q + 8), beside

    weight_zero    (N, K / G) int8    the zero point z of each group (0 .. 16)
    g_idx          (K,) int32         the group of each input column (GPTQ desc_act), else k // G

    W[n, k] = (u[n, k] - z[n, g(k)]) * weight_scale[n, g(k)]

which `dequantize_int4_groups` computes on every call (no kernel: the Triton one is for the
symmetric, ordered case only).

`quantize_int4(weight, group_size)` makes the layout from a float weight (symmetric, round to
nearest, scale = amax / 7.5 as compressed-tensors' minmax observer), `pack_int4` packs as its
`pack_to_int32` does (tests/unit/layers/test_int4.py checks both against its fixture).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers import fused
from omnistage.layers.fp8 import shard_of
from omnistage.layers.parallel import TPGroup, all_gather_last, all_reduce

SHIFTS = tuple(range(0, 32, 4))
GROUP_SIZE = 128            # quantize-at-load groups (ar/quantize.py), as llm-compressor


def unpack_int4(packed: Tensor, num_columns: int) -> Tensor:
    """(N, ceil(K / 8)) int32 words -> (N, K) int8 in [-8, 7]."""
    shifts = torch.tensor(SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF                  # (N, K / 8, 8)
    return (nibbles.flatten(1)[:, :num_columns] - 8).to(torch.int8)


def pack_int4(q: Tensor) -> Tensor:
    """(N, K) integers in [-8, 7] -> (N, ceil(K / 8)) int32 words, value i of a word at bits
    4i..4i+3 as q + 8, the last word padded with zero nibbles (compressed-tensors'
    `pack_to_int32` for 4 bits)."""
    assert int(q.min()) >= -8 and int(q.max()) <= 7, (int(q.min()), int(q.max()))
    n, k = q.shape
    u = F.pad((q.to(torch.int32) + 8), (0, -k % 8)).view(n, -1, 8)       # (N, K / 8, 8)
    packed = torch.zeros(u.shape[:2], dtype=torch.int32, device=q.device)
    for i, shift in enumerate(SHIFTS):
        packed |= u[..., i] << shift                   # int32 shifts wrap: bit 31 is the sign
    return packed


def quantize_int4(weight: Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16
                  ) -> tuple[Tensor, Tensor]:
    """A float weight (N, K) -> (packed (N, ceil(K / 8)) int32, scale (N, ceil(K / G))):
    symmetric groups of `group_size` along K, scale = amax / 7.5 rounded to `scale_dtype`,
    q = round(W / scale) clamped to [-8, 7]."""
    n, k = weight.shape
    groups = -(-k // group_size)
    w = F.pad(weight.float(), (0, groups * group_size - k)).view(n, groups, group_size)
    scale = (w.abs().amax(-1) / 7.5).clamp(min=1e-8).to(scale_dtype)     # (N, groups)
    q = torch.round(w / scale.float()[..., None]).clamp(-8, 7).flatten(1)[:, :k]
    return pack_int4(q), scale


def dequantize_int4(packed: Tensor, scale: Tensor, num_columns: int, group_size: int
                    ) -> Tensor:
    """The weight (N, K) the packed words and per-group scales stand for, in the scales' dtype
    (each product rounded to it, as compressed-tensors' `dequantize` computes it)."""
    q = unpack_int4(packed, num_columns).to(scale.dtype)
    return q * scale.repeat_interleave(group_size, dim=1)[:, :num_columns]


def dequantize_int4_groups(packed: Tensor, scale: Tensor, zero: Tensor | None,
                           g_idx: Tensor | None, num_columns: int, group_size: int) -> Tensor:
    """The weight (N, K) of unsigned nibbles u with per-group zero points (None: 8, the
    symmetric layout) and an optional column-to-group map: (u - z[n, g(k)]) * s[n, g(k)] in
    the scales' dtype (the difference is a small integer, exact in any float dtype)."""
    u = unpack_int4(packed, num_columns).to(torch.int16) + 8                 # (N, K) 0..15
    groups = (g_idx.long() if g_idx is not None else
              torch.arange(num_columns, device=packed.device) // group_size)
    q = u - (8 if zero is None else zero[:, groups].to(torch.int16))         # (N, K)
    return q.to(scale.dtype) * scale[:, groups]


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W packed 4-bit by groups (module docstring). Keeps the
    tensor-parallel duties of a layer it replaces (as layers/fp8.py's Fp8Linear): a
    row-parallel one adds the bias on rank 0 only and all-reduces (`reduce_results`), a
    column-parallel one with `gather_output` gathers the ranks' outputs."""

    def __init__(self, weight_packed: Tensor, weight_scale: Tensor, in_features: int,
                 group_size: int, bias: Tensor | None = None, tp: TPGroup | None = None,
                 gather_output: bool = False, reduce_results: bool = False,
                 weight_zero: Tensor | None = None, g_idx: Tensor | None = None) -> None:
        super().__init__()
        self._init(weight_packed.shape[0], in_features, group_size, tp, gather_output,
                   reduce_results)
        check_layout(weight_packed, weight_scale, in_features, group_size)
        if weight_zero is not None and weight_zero.shape != weight_scale.shape:
            raise ValueError(f"weight_zero: the scales' shape {tuple(weight_scale.shape)} "
                             f"expected, got {tuple(weight_zero.shape)}")
        if g_idx is not None and g_idx.shape != (in_features,):
            raise ValueError(f"g_idx: ({in_features},) expected, got {tuple(g_idx.shape)}")
        self.register_buffer("weight_packed", weight_packed)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_zero", weight_zero)
        self.register_buffer("g_idx", g_idx)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Module, group_size: int = GROUP_SIZE) -> Int4Linear:
        """The W4A16 form of one of layers/fp8.py's LINEARS, quantized at load by
        `quantize_int4` (scales in the weight's dtype): its local shard, with its bias as it
        adds it and its tensor-parallel duties. A row-parallel shard's K must be whole groups
        (the ranks' groups then are the whole weight's); ValueError otherwise."""
        weight, bias, tp, kw = shard_of(linear)
        n, k = weight.shape
        if "reduce_results" in kw and tp.world_size > 1 and k % group_size:
            raise ValueError(f"int4 with tensor parallelism {tp.world_size}: a row-parallel "
                             f"linear's {k} inputs a rank are not whole groups of "
                             f"{group_size}")
        packed, scale = quantize_int4(weight.detach(), group_size, weight.dtype)
        bias = None if bias is None else bias.detach().clone()
        return cls(packed, scale, k, group_size, bias, tp, **kw)

    def _init(self, out_features: int, in_features: int, group_size: int, tp: TPGroup | None,
              gather_output: bool, reduce_results: bool) -> None:
        self.out_features, self.in_features, self.group_size = (
            out_features, in_features, group_size)                        # this rank's shard
        self.tp = tp if tp is not None else TPGroup(0, 1, None)
        self.gather_output, self.reduce_results = gather_output, reduce_results
        self.row_parallel = False       # a row-parallel shard: rank 0's part adds the bias

    @property
    def weight(self) -> Tensor:
        """The packed int32 words under the name the one-row kernels of fused.py dispatch
        on: no bf16 / FP8 kernel takes an int32 weight, so they call this layer (which takes
        its own kernel) and the one-kernel-a-layer path (triton_decoder_layer.py) declines."""
        return self.parts()[0]

    def parts(self) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """(packed words, scales, zero points or None, g_idx or None) of this rank's shard;
        subclasses that hold them under a checkpoint's names say so here."""
        return (self.weight_packed, self.weight_scale, self._buffers.get("weight_zero"),
                self._buffers.get("g_idx"))

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        packed, scale, zero, g_idx = self.parts()
        if zero is None and g_idx is None:
            return dequantize_int4(packed, scale, self.in_features, self.group_size).to(dtype)
        return dequantize_int4_groups(packed, scale, zero, g_idx, self.in_features,
                                      self.group_size).to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)                              # (M, K)
        bias = self.bias
        if bias is not None and self.row_parallel and self.tp.rank != 0:
            bias = None                                  # the sum over ranks holds it once
        bias = None if bias is None else bias.to(x.dtype)
        packed, scale, zero, g_idx = self.parts()
        if zero is None and g_idx is None and fused.ops_for(x2) is not None:
            from omnistage.layers import triton_int4

            if triton_int4.applies(x2, packed, scale, self.group_size):
                y = triton_int4.linear(x2, packed, scale, self.group_size, bias)
                return self.finish(y.unflatten(0, x.shape[:-1]))
        y = F.linear(x2, self.dequantized(x.dtype), bias)
        return self.finish(y.unflatten(0, x.shape[:-1]))

    def finish(self, y: Tensor) -> Tensor:
        """This rank's product combined as the replaced layer did."""
        if self.reduce_results:
            y = all_reduce(y, self.tp)
        return all_gather_last(y, self.tp) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group={self.group_size}, "
                f"bias={self.bias is not None}")


def check_layout(weight_packed: Tensor, weight_scale: Tensor, in_features: int,
                 group_size: int) -> None:
    """ValueError unless the words are (N, ceil(K / 8)) int32 and the scales (N, ceil(K / G))."""
    n = weight_packed.shape[0]
    if weight_packed.dtype != torch.int32 or weight_packed.shape[1] != -(-in_features // 8):
        raise ValueError(f"weight_packed: (N, K / 8) int32 for K={in_features}, got "
                         f"{weight_packed.dtype} {tuple(weight_packed.shape)}")
    if weight_scale.shape != (n, -(-in_features // group_size)):
        raise ValueError(f"weight_scale: (N, K / {group_size}) expected, got "
                         f"{tuple(weight_scale.shape)}")
