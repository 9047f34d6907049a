"""4-bit weight-only linears (W4A16, issue 44) in compressed-tensors' `pack-quantized` layout,
what vLLM reads for the W4A16 releases of llm-compressor (GPTQ / AWQ-made, saved packed):

    weight_packed  (N, K / 8) int32   eight 4-bit values a word, value i at bits 4i..4i+3,
                                      stored as q + 8 (q in [-8, 7], symmetric)
    weight_scale   (N, K / G)         one scale per group of G inputs (bf16 / fp16 / fp32)
    weight_shape   [N, K]

    W[n, k] = q[n, k] * weight_scale[n, k // G]

`Int4Linear` keeps the packed words (a quarter of bf16's bytes, plus the scales) and
dequantizes them on every call before one matmul in the activations' dtype: a decode step is
bound by reading weights, and these are read at 4 bits. No fused dequant-GEMM kernel yet (the
dequantized weight is a temporary of the call). Asymmetric groups (a zero point) and
activation-ordered GPTQ (`g_idx`) are not read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SHIFTS = tuple(range(0, 32, 4))


def unpack_int4(packed: Tensor, num_columns: int) -> Tensor:
    """(N, ceil(K / 8)) int32 words -> (N, K) int8 in [-8, 7]."""
    shifts = torch.tensor(SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF                  # (N, K / 8, 8)
    return (nibbles.flatten(1)[:, :num_columns] - 8).to(torch.int8)


def dequantize_int4(packed: Tensor, scale: Tensor, num_columns: int, group_size: int
                    ) -> Tensor:
    """The weight (N, K) the packed words and per-group scales stand for, in the scales' dtype
    (each product rounded to it, as compressed-tensors' `dequantize` computes it)."""
    q = unpack_int4(packed, num_columns).to(scale.dtype)
    return q * scale.repeat_interleave(group_size, dim=1)[:, :num_columns]


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W packed 4-bit by groups (module docstring), dequantized per call."""

    def __init__(self, weight_packed: Tensor, weight_scale: Tensor, in_features: int,
                 group_size: int, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features, self.group_size = (
            weight_packed.shape[0], in_features, group_size)
        if weight_packed.dtype != torch.int32 or weight_packed.shape[1] * 8 < in_features:
            raise ValueError(f"weight_packed: (N, K / 8) int32 for K={in_features}, got "
                             f"{weight_packed.dtype} {tuple(weight_packed.shape)}")
        if weight_scale.shape != (self.out_features, -(-in_features // group_size)):
            raise ValueError(f"weight_scale: (N, K / {group_size}) expected, got "
                             f"{tuple(weight_scale.shape)}")
        self.register_buffer("weight_packed", weight_packed)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        return dequantize_int4(self.weight_packed, self.weight_scale, self.in_features,
                               self.group_size).to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group={self.group_size}, "
                f"bias={self.bias is not None}")
