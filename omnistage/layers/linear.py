"""Linear layers whose weights the loader fills piece by piece.

Checkpoints store q_proj/k_proj/v_proj and gate_proj/up_proj as separate tensors; we keep one
fused weight each so a layer runs one matmul. Every parameter carries a `weight_loader(param,
loaded_weight[, shard_id])` (the nano-vllm hook) that copies a checkpoint tensor into its rows:

    QKVLinear.weight   rows: | q: H*D | k: Hkv*D | v: Hkv*D |
    MergedLinear.weight rows: | shard 0 | shard 1 | ...

These are the single-device layers: a shard is a contiguous block of rows. The
tensor-parallel ones, whose loaders keep each rank's slice, are in parallel.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def copy_checked(dst: Tensor, src: Tensor) -> None:
    """Copy `src` into `dst`; a shape mismatch raises ValueError naming both shapes."""
    if dst.shape != src.shape:
        raise ValueError(f"expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded_weight: Tensor) -> None:
    copy_checked(param.data, loaded_weight)


class Linear(nn.Module):
    """y = x W^T (+ b). Weights start uninitialised: the loader fills them."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Tensor) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output (gate_up_proj)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias)

    def shard_rows(self, shard_id: int) -> tuple[int, int]:
        """(offset, size) of shard `shard_id` along the output dim."""
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded_weight: Tensor,
                      shard_id: int | str | None = None) -> None:
        if shard_id is None:  # a checkpoint that already stores the fused tensor
            return default_weight_loader(param, loaded_weight)
        offset, size = self.shard_rows(shard_id)
        copy_checked(param.data.narrow(0, offset, size), loaded_weight)


class QKVLinear(MergedLinear):
    """q, k and v projections in one weight; shard ids "q", "k", "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias)

    def shard_rows(self, shard_id: int | str) -> tuple[int, int]:
        assert shard_id in ("q", "k", "v"), f"QKVLinear shard_id {shard_id!r} not in q, k, v"
        return super().shard_rows("qkv".index(shard_id))
