"""4-bit linears filled from a checkpoint that ships them packed (issue 44): compressed-tensors'
W4A16 `pack-quantized` layout (layers/int4.py's docstring), read as the file stores it, never
through a float copy of the weight. For every quantized linear `P`

    P.weight_packed  (N, ceil(K / 8)) int32
    P.weight_scale   (N, ceil(K / G))  bf16 / fp16 / fp32 (held in the model's dtype)
    P.weight_shape   [N, K]            int64, checked, not kept
    P.bias           (N,)              if the linear has one (stays float)

`Int4CheckpointLinear.from_linear(linear, group_size)` is an empty Int4Linear in the place of
`linear` (one of layers/fp8.py's LINEARS) whose tensors the loader fills:

  - the fused q/k/v and gate/up take each part's rows, and a column-parallel layer its rank's
    rows, through `linear`'s own weight loader (it slices along the output, whatever the
    width of the rows);
  - a row-parallel layer takes its rank's columns: K / R inputs are K / (8 R) words and
    K / (G R) groups, so K / R must be a multiple of 8 and of G (refused otherwise, naming
    tensor parallelism); its bias is added by rank 0 only, before the all-reduce.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from omnistage.layers.fp8_checkpoint import checkpoint_rows
from omnistage.layers.int4 import Int4Linear
from omnistage.layers.linear import copy_checked, default_weight_loader
from omnistage.layers.parallel import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear


def _param(module: nn.Module, name: str, data: Tensor, loader: object) -> None:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = loader
    module.register_parameter(name, param)


class Int4CheckpointLinear(Int4Linear):
    """An Int4Linear whose packed words, scales and bias are parameters the loader fills."""

    def __init__(self, linear: nn.Module, group_size: int) -> None:
        nn.Module.__init__(self)
        n, k = linear.weight.shape                                        # this rank's shard
        row = isinstance(linear, RowParallelLinear)
        tp = linear.tp if isinstance(linear, (RowParallelLinear, ColumnParallelLinear,
                                              QKVParallelLinear)) else None
        self._init(n, k, group_size, tp, isinstance(linear, ColumnParallelLinear)
                   and linear.gather_output, row and linear.reduce_results)
        self.row_parallel = row
        if group_size % 8 and self.tp.world_size > 1:
            raise ValueError(f"int4 groups of {group_size}: tensor parallelism needs groups "
                             "of whole 32-bit words (a multiple of 8)")
        if row and self.tp.world_size > 1 and (k % 8 or k % group_size):
            raise ValueError(f"int4 with tensor parallelism {self.tp.world_size}: a "
                             f"row-parallel linear's {k} inputs a rank are not whole words "
                             f"and groups of {group_size}")
        whole_k = k * self.tp.world_size if row else k
        self.whole_in_features = whole_k
        loader = getattr(linear.weight, "weight_loader", default_weight_loader)
        dev, dtype = linear.weight.device, linear.weight.dtype
        _param(self, "weight_packed", torch.empty(n, -(-k // 8), dtype=torch.int32, device=dev),
               self._columns(8, -(-whole_k // 8)) if row else loader)
        _param(self, "weight_scale", torch.empty(n, -(-k // group_size), dtype=dtype,
                                                 device=dev),
               self._columns(group_size, -(-whole_k // group_size)) if row else loader)
        _param(self, "weight_shape", torch.tensor([n, k], device=dev), self._shape_loader(linear))
        if linear.bias is None:
            self.register_parameter("bias", None)
        else:
            _param(self, "bias", torch.empty_like(linear.bias),
                   getattr(linear.bias, "weight_loader", default_weight_loader))

    @classmethod
    def from_linear(cls, linear: nn.Module, group_size: int) -> Int4CheckpointLinear:
        return cls(linear, group_size)

    def _columns(self, per: int, whole: int):
        """A row-parallel layer's loader: this rank's columns of a (N, whole) tensor whose
        column c stands for inputs c * per .. (c + 1) * per."""
        def load(param: nn.Parameter, loaded: Tensor) -> None:
            if tuple(loaded.shape) != (self.out_features, whole):
                raise ValueError(f"expected shape {(self.out_features, whole)}, got "
                                 f"{tuple(loaded.shape)}")
            size = param.shape[1]
            copy_checked(param.data, loaded.narrow(1, self.tp.rank * (self.in_features // per),
                                                   size))
        return load

    def _shape_loader(self, linear: nn.Module):
        """`weight_shape` [N, K] of the checkpoint's (part of the) tensor: checked against the
        rows `linear` takes for that part and the whole input width."""
        def load(param: nn.Parameter, loaded: Tensor, shard_id: int | str | None = None
                 ) -> None:
            want = [checkpoint_rows(linear, shard_id), self.whole_in_features]
            if loaded.tolist() != want:
                raise ValueError(f"weight_shape {loaded.tolist()}, the model's is {want}")
        return load
