"""FP8 linears filled from a checkpoint that ships them quantized (issue 44): the float8 weight
and its scales are read as the file stores them, never through a bf16 copy of the weight.

The layout is compressed-tensors' "float-quantized" one, what vLLM reads for a
`quantization_config.quant_method == "compressed-tensors"` model (llm-compressor's FP8 /
FP8-dynamic releases): for every quantized linear `P`

    P.weight        (N, K) float8_e4m3fn
    P.weight_scale  (N, 1) per output channel, or (1,) / () one per tensor; bf16 or fp32

and the activations quantized per token at run time (`dynamic: true`, as Fp8Linear does). A
per-tensor scale becomes the same value on each of its rows: one rowwise `_scaled_mm` then runs
a fused q/k/v or gate/up whose parts carry different scales, exactly.

`Fp8CheckpointLinear.from_linear(linear)` is an empty Fp8Linear in the place of `linear` whose
parameters take their checkpoint tensors through `linear`'s own weight loader (the fused
layers' q/k/v and gate/up shards, each rank's slice under tensor parallelism).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from omnistage.layers.fp8 import FP8, Fp8Linear, shard_of
from omnistage.layers.linear import MergedLinear, copy_checked, default_weight_loader
from omnistage.layers.parallel import (MergedColumnParallelLinear, QKVParallelLinear,
                                       RowParallelLinear)


def checkpoint_rows(linear: nn.Module, shard_id: int | str | None) -> int:
    """Rows of the checkpoint tensor that `linear`'s loader takes for `shard_id` (before any
    tensor-parallel slicing)."""
    if shard_id is None:
        return linear.out_features
    if isinstance(linear, QKVParallelLinear):
        return linear.total_sizes[shard_id]
    if isinstance(linear, MergedColumnParallelLinear):
        return linear.output_sizes[shard_id]
    if isinstance(linear, MergedLinear):
        return linear.shard_rows(shard_id)[1]
    raise ValueError(f"{type(linear).__name__} has no shard {shard_id!r}")


def _param(module: nn.Module, name: str, data: Tensor, loader: object) -> None:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = loader
    module.register_parameter(name, param)


class Fp8CheckpointLinear(Fp8Linear):
    """An Fp8Linear whose e4m3 weight and (N, 1) scales are parameters the loader fills."""

    def __init__(self, linear: nn.Module) -> None:
        nn.Module.__init__(self)
        weight, bias, tp, kw = shard_of(linear)
        if bias is not linear.bias:
            raise ValueError("an FP8 checkpoint's row-parallel linear with a bias on several "
                             "ranks is not supported")
        self.out_features, self.in_features = weight.shape                 # this rank's shard
        self.tp = tp
        self.gather_output = kw.get("gather_output", False)
        self.reduce_results = kw.get("reduce_results", False)
        loader = getattr(linear.weight, "weight_loader", default_weight_loader)
        dev = weight.device
        _param(self, "weight", torch.empty(weight.shape, dtype=FP8, device=dev), loader)
        _param(self, "weight_scale", torch.empty(self.out_features, 1, device=dev),
               self._scale_loader(linear, loader))
        if bias is None:
            self.register_parameter("bias", None)
        else:                                    # bf16: the matmul's epilogue adds it
            _param(self, "bias", torch.empty(self.out_features, dtype=torch.bfloat16,
                                             device=dev),
                   getattr(linear.bias, "weight_loader", default_weight_loader))

    @classmethod
    def from_linear(cls, linear: nn.Module) -> Fp8CheckpointLinear:
        return cls(linear)

    @staticmethod
    def _scale_loader(linear: nn.Module, weight_loader: object):
        """The scales' loader: per tensor spread over its rows, then the rows routed as the
        weight's are (a row-parallel layer keeps every output row: no slicing)."""
        def load(param: nn.Parameter, loaded: Tensor, shard_id: int | str | None = None
                 ) -> None:
            scale = loaded.float().reshape(-1, 1)                          # (rows or 1, 1)
            if scale.shape[0] == 1:
                scale = scale.expand(checkpoint_rows(linear, shard_id), 1)
            if isinstance(linear, RowParallelLinear) or weight_loader is default_weight_loader:
                copy_checked(param.data, scale)
            elif shard_id is None:
                weight_loader(param, scale)
            else:
                weight_loader(param, scale, shard_id)
        return load
