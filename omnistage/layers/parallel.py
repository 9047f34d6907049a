"""Tensor-parallel layers (issue 18's groundwork): the weights of one stage split over the ranks
of its `torch.distributed` group, each rank loading only its slice of every checkpoint tensor.

    ColumnParallelLinear        W (out, in): rank r keeps rows r*out/R .. (r+1)*out/R; its output
                                is that slice of y (no communication)
    MergedColumnParallelLinear  gate_up: each shard split by rows, rank r keeps | gate_r | up_r |
    QKVParallelLinear           q heads split over ranks; k / v heads split too, or replicated
                                when fewer than ranks (each rank keeps the kv head its q heads
                                read: q head h reads kv head h // (Hq / Hkv))
    RowParallelLinear           W (out, in): rank r keeps columns r*in/R ..; takes its slice of x,
                                all-reduces the partial sums (bias added once, after)
    VocabParallelEmbedding      rank r keeps vocabulary rows r*V/R ..; ids outside embed to 0,
                                all-reduce
    ParallelLMHead              the vocabulary split by rows; logits all-gathered

The group is the stage's (`set_tp_group`); with none set, world size 1 and every layer is its
single-device self. Checkpoint tensors arrive whole (from safetensors, lazily per tensor) and
each loader narrows them to the rank's slice before copying, so a rank never holds a second
full copy of a weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.linear import copy_checked, default_weight_loader


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int
    world_size: int
    group: object | None      # a torch.distributed ProcessGroup; None: one rank


_SINGLE = TPGroup(0, 1, None)
_current = _SINGLE


def set_tp_group(group: TPGroup | None) -> None:
    """The tensor-parallel group the layers built from now on split over (None: one rank)."""
    global _current
    _current = group or _SINGLE


def tp_group() -> TPGroup:
    return _current


def divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {parts}")
    return n // parts


def _parameter(module: nn.Module, name: str, shape: tuple[int, ...] | None,
               loader: object) -> None:
    """An uninitialised, loader-filled parameter `name` of `module` (shape None: absent)."""
    if shape is None:
        module.register_parameter(name, None)
        return
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader
    module.register_parameter(name, param)


def _narrow(loaded: Tensor, dim: int, start: int, size: int, whole: tuple[int, ...]) -> Tensor:
    """This rank's slice of a checkpoint tensor that must have the shape `whole` (ValueError
    naming both shapes otherwise, as `copy_checked` says for a whole tensor)."""
    if tuple(loaded.shape) != whole:
        raise ValueError(f"expected shape {whole}, got {tuple(loaded.shape)}")
    return loaded.narrow(dim, start, size)


def all_reduce(x: Tensor, tp: TPGroup) -> Tensor:
    if tp.world_size > 1:
        dist.all_reduce(x, group=tp.group)
    return x


def all_gather_last(x: Tensor, tp: TPGroup) -> Tensor:
    """Concatenate every rank's x along the last dimension, in rank order."""
    if tp.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.world_size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T (+ b_r): this rank's rows of the output. gather_output: the whole y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 gather_output: bool = False) -> None:
        super().__init__()
        self.tp = tp_group()
        self.in_features = in_features
        self.out_features = out_features
        self.local_out = divide(out_features, self.tp.world_size, "output features")
        self.gather_output = gather_output
        _parameter(self, "weight", (self.local_out, in_features), self.weight_loader)
        _parameter(self, "bias", (self.local_out,) if bias else None, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Tensor) -> None:
        """The whole checkpoint tensor (out, ...) -> this rank's rows."""
        whole = (self.out_features, *param.shape[1:])
        copy_checked(param.data, _narrow(loaded_weight, 0, self.tp.rank * self.local_out,
                                         self.local_out, whole))

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        return all_gather_last(y, self.tp) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Projections of one input stacked along the output (gate_up), each split over ranks:
    this rank's weight rows are | shard 0's slice | shard 1's slice | ..."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        tp = tp_group()
        self.output_sizes = list(output_sizes)
        self.local_sizes = [divide(s, tp.world_size, f"shard of {s} features")
                            for s in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias)

    def shard_rows(self, shard_id: int) -> tuple[int, int, int]:
        """(offset in this rank's weight, size here, offset in the checkpoint's shard)."""
        size = self.local_sizes[shard_id]
        return sum(self.local_sizes[:shard_id]), size, self.tp.rank * size

    def weight_loader(self, param: nn.Parameter, loaded_weight: Tensor,
                      shard_id: int | None = None) -> None:
        if shard_id is None:     # a checkpoint storing the fused tensor: split it into shards
            start = 0
            for i, size in enumerate(self.output_sizes):
                self.weight_loader(param, loaded_weight.narrow(0, start, size), i)
                start += size
            return
        offset, size, src = self.shard_rows(shard_id)
        copy_checked(param.data.narrow(0, offset, size), loaded_weight.narrow(0, src, size))


class QKVParallelLinear(nn.Module):
    """q, k, v in one weight; shard ids "q", "k", "v". Rank r keeps q heads r*Hq/R .. and the
    kv heads those read: a slice of the kv heads when Hkv >= R, else one kv head replicated
    over R/Hkv ranks. Its rows: | q_r | k_r | v_r |."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        super().__init__()
        self.tp = tp = tp_group()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp.world_size, "attention heads")
        if num_kv_heads >= tp.world_size:
            self.num_kv_heads = divide(num_kv_heads, tp.world_size, "key/value heads")
            self.kv_start = tp.rank * self.num_kv_heads
        else:
            divide(tp.world_size, num_kv_heads, "ranks per key/value head")
            self.num_kv_heads = 1
            self.kv_start = tp.rank * num_kv_heads // tp.world_size
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        rows = self.q_size + 2 * self.kv_size
        _parameter(self, "weight", (rows, hidden_size), self.weight_loader)
        _parameter(self, "bias", (rows,) if bias else None, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Tensor,
                      shard_id: str | None = None) -> None:
        """The checkpoint's whole q_proj / k_proj / v_proj -> this rank's heads of it."""
        assert shard_id in ("q", "k", "v"), f"QKVParallelLinear shard_id {shard_id!r}"
        q, kv = self.q_size, self.kv_size
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        src = self.tp.rank * q if shard_id == "q" else self.kv_start * self.head_dim
        copy_checked(param.data.narrow(0, offset, size), loaded_weight.narrow(0, src, size))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, (+ b once): x_r is this rank's slice of the input (what
    a column-parallel layer before it produced)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.tp = tp_group()
        self.in_features = in_features
        self.out_features = out_features
        self.local_in = divide(in_features, self.tp.world_size, "input features")
        _parameter(self, "weight", (out_features, self.local_in), self.weight_loader)
        # the bias is whole on every rank, added once after the sum
        _parameter(self, "bias", (out_features,) if bias else None, default_weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Tensor) -> None:
        whole = (self.out_features, self.in_features)
        copy_checked(param.data, _narrow(loaded_weight, 1, self.tp.rank * self.local_in,
                                         self.local_in, whole))

    def forward(self, x: Tensor) -> Tensor:
        y = all_reduce(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rank r keeps vocabulary rows r*V/R .. (r+1)*V/R; an id outside them embeds to zeros
    here, and the all-reduce sums in the rank that has it."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp = tp_group()
        self.num_embeddings = num_embeddings
        self.local_rows = divide(num_embeddings, self.tp.world_size, "vocabulary size")
        self.start = self.tp.rank * self.local_rows
        _parameter(self, "weight", (self.local_rows, embedding_dim), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Tensor) -> None:
        copy_checked(param.data, loaded_weight.narrow(0, self.start, self.local_rows))

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0), self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection over a split vocabulary: each rank's logits for its rows,
    gathered into the whole vocabulary in rank order."""

    def forward(self, hidden: Tensor) -> Tensor:                   # (T, H) -> (T, V)
        return all_gather_last(F.linear(hidden, self.weight), self.tp)
