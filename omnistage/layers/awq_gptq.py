"""4-bit linears filled from AutoAWQ (GEMM) and GPTQ checkpoints (issue 44), the two layouts
most published 4-bit LLMs ship in. For a linear y = x W^T with W (N, K) and groups of G inputs:

    AutoAWQ GEMM   qweight (K, N / 8) int32   along N, nibble i of a word holding column
                                              8w + AWQ_ORDER[i] (AWQ_ORDER = 0 2 4 6 1 3 5 7)
                   qzeros  (K / G, N / 8)     the same order
                   scales  (K / G, N) fp16
                   W[n, k] = (q[k, n] - z[k / G, n]) * s[k / G, n]
    GPTQ           qweight (K / 8, N) int32   along K, row 8w + i at bits 4i..4i+3
                   qzeros  (K / G, N / 8)     along N, sequential; the "gptq" (v1) format
                                              stores z - 1 (clamped at 0), "gptq_v2" z itself
                   scales  (K / G, N)
                   g_idx   (K,) int32         the group of each input (desc_act: any order)
                   W[n, k] = (q[k, n] - z[g[k], n]) * s[g[k], n]

Nothing is dequantized at load: each tensor is turned around into layers/int4.py's layout,
(N, ...) rows, the words re-packed along K (the same 4 bits a value, the same bytes), and
`PackedInt4Linear` (an Int4Linear) dequantizes per call with zero points and g_idx. GPTQ's
symmetric checkpoints (sym: every zero 8) keep no zero points, and without act order take
Int4Linear's Triton decode kernel; the zeros are checked to be 8 at load.

Tensor parallelism, as layers/int4_checkpoint.py: column-parallel and fused layers take their
rows through the replaced linear's own loader (after the turn-around, the rows are the output
dim); a row-parallel layer takes its rank's columns of the words (K / R a multiple of 8) and
groups (a multiple of G), or with act order every group (its columns' g_idx point anywhere)
and its columns of g_idx. The parts of a fused GPTQ linear (q/k/v, gate/up) quantized with act
order must share one g_idx (GPTQ orders by the shared input's Hessian), else refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from omnistage.layers.int4 import Int4Linear, pack_int4
from omnistage.layers.linear import copy_checked, default_weight_loader
from omnistage.layers.parallel import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)        # nibble i of an AWQ word holds column AWQ_ORDER[i]
SEQUENTIAL = tuple(range(8))


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """What a checkpoint's quantization_config says (models/awq_gptq.py reads it)."""
    method: str                 # "awq" | "gptq"
    group_size: int             # -1: one group over the whole input (GPTQ per channel)
    zero_offset: int = 0        # added to a stored zero: 1 for GPTQ's v1 format
    symmetric: bool = False     # GPTQ sym: zeros all 8, not kept
    act_order: bool = False     # GPTQ desc_act: g_idx kept


def _param(module: nn.Module, name: str, data: Tensor, loader: Callable) -> None:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = loader
    module.register_parameter(name, param)


def nibbles(words: Tensor) -> Tensor:
    """(..., W) int32 -> (..., W, 8) int32 in [0, 15], nibble i from bits 4i..4i+3."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return (words.unsqueeze(-1) >> shifts) & 0xF


def unpack_columns(words: Tensor, order: tuple[int, ...]) -> Tensor:
    """(R, C / 8) words packed along the columns -> (R, C): column 8w + order[i] is nibble i
    of word w."""
    nib = nibbles(words)                                                  # (R, C / 8, 8)
    out = torch.empty_like(nib)
    out[..., list(order)] = nib
    return out.flatten(1)


def unpack_rows(words: Tensor) -> Tensor:
    """(R / 8, C) words packed along the rows -> (R, C): row 8w + i is nibble i of word w."""
    return nibbles(words).permute(0, 2, 1).flatten(0, 1)


def repack(u: Tensor) -> Tensor:
    """(N, K) unsigned nibbles -> layers/int4.py's (N, K / 8) words (stored u, read u - 8)."""
    return pack_int4(u - 8)


def _check(loaded: Tensor, shape: tuple[int | None, ...], name: str) -> None:
    """ValueError unless `loaded` has `shape` (None: any size there)."""
    if loaded.dim() != len(shape) or any(w is not None and w != g
                                         for w, g in zip(shape, loaded.shape)):
        want = tuple("*" if w is None else w for w in shape)
        raise ValueError(f"{name}: expected shape {want}, got {tuple(loaded.shape)}")


class PackedInt4Linear(Int4Linear):
    """An Int4Linear whose `qweight`, `qzeros`, `scales` (and GPTQ's `g_idx`) are parameters
    under the checkpoint's names, filled turned around into Int4Linear's rows (docstring)."""

    def __init__(self, linear: nn.Module, layout: PackedLayout) -> None:
        nn.Module.__init__(self)
        n, k = linear.weight.shape                                        # this rank's shard
        row = isinstance(linear, RowParallelLinear)
        tp = linear.tp if isinstance(linear, (RowParallelLinear, ColumnParallelLinear,
                                              QKVParallelLinear)) else None
        world = tp.world_size if tp is not None else 1
        whole_k = k * world if row else k
        group = whole_k if layout.group_size == -1 else layout.group_size
        self._init(n, k, group, tp, isinstance(linear, ColumnParallelLinear)
                   and linear.gather_output, row and linear.reduce_results)
        self.row_parallel, self.layout, self.whole_in_features = row, layout, whole_k
        # a row-parallel rank's groups: its own, or every group when g_idx may point anywhere
        # (act order) or one group spans every input (group_size -1)
        self.all_groups = row and (layout.act_order or group == whole_k)
        self._check_shapes(row, k, whole_k, group)
        groups = whole_k // group if (self.all_groups or not row) else k // group
        outer = getattr(linear.weight, "weight_loader", default_weight_loader)
        dev, dtype = linear.weight.device, linear.weight.dtype
        _param(self, "qweight", torch.empty(n, k // 8, dtype=torch.int32, device=dev),
               self._loader(self._qweight_rows, outer, 8))
        _param(self, "scales", torch.empty(n, groups, dtype=dtype, device=dev),
               self._loader(self._scale_rows, outer, None if self.all_groups else group))
        zeros = torch.empty(0 if layout.symmetric else n, groups, dtype=torch.int8, device=dev)
        _param(self, "qzeros", zeros, self._check_symmetric if layout.symmetric else
               self._loader(self._zero_rows, outer, None if self.all_groups else group))
        if layout.method == "gptq":
            g_idx = torch.full((k if layout.act_order else 0,), -1, dtype=torch.int32,
                               device=dev)
            _param(self, "g_idx", g_idx, self._load_g_idx)
        if linear.bias is None:
            self.register_parameter("bias", None)
        else:
            _param(self, "bias", torch.empty_like(linear.bias),
                   getattr(linear.bias, "weight_loader", default_weight_loader))

    def _check_shapes(self, row: bool, k: int, whole_k: int, group: int) -> None:
        if whole_k % group or whole_k % 8:
            raise ValueError(f"{self.layout.method} 4-bit: {whole_k} inputs are not whole "
                             f"groups of {group} and words of 8")
        if row and self.tp.world_size > 1 and (k % 8 or (k % group and not
                                                         self.all_groups)):
            raise ValueError(f"{self.layout.method} 4-bit with tensor parallelism "
                             f"{self.tp.world_size}: a row-parallel linear's {k} inputs a "
                             f"rank are not whole words and groups of {group}")

    def parts(self) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        zero = None if self.layout.symmetric else self.qzeros
        return self.qweight, self.scales, zero, self.g_idx if self.layout.act_order else None

    # ---- the checkpoint's tensors turned into (N, ...) rows --------------------------------

    def _qweight_rows(self, loaded: Tensor) -> Tensor:
        k = self.whole_in_features
        if self.layout.method == "awq":
            _check(loaded, (k, None), "qweight (K, N / 8)")
            return repack(unpack_columns(loaded, AWQ_ORDER).T)
        _check(loaded, (k // 8, None), "qweight (K / 8, N)")
        return repack(unpack_rows(loaded).T)

    def _scale_rows(self, loaded: Tensor) -> Tensor:
        _check(loaded, (self.whole_in_features // self.group_size, None), "scales (K / G, N)")
        return loaded.T

    def _zero_rows(self, loaded: Tensor) -> Tensor:
        _check(loaded, (self.whole_in_features // self.group_size, None),
               "qzeros (K / G, N / 8)")
        order = AWQ_ORDER if self.layout.method == "awq" else SEQUENTIAL
        return (unpack_columns(loaded, order) + self.layout.zero_offset).T.to(torch.int8)

    def _loader(self, rows: Callable[[Tensor], Tensor], outer: Callable, per: int | None):
        """A loader that turns the tensor into rows, then fills this rank's part: through the
        replaced linear's loader (its rows), or for a row-parallel layer this rank's columns
        (column c standing for inputs c * per ..; per None: every column)."""
        def load(param: nn.Parameter, loaded: Tensor, shard_id: int | str | None = None
                 ) -> None:
            mine = rows(loaded)
            if not self.row_parallel:
                outer(param, mine) if shard_id is None else outer(param, mine, shard_id)
                return
            if mine.shape[0] != self.out_features:
                raise ValueError(f"{self.out_features} outputs expected, got {mine.shape[0]}")
            start = 0 if per is None else self.tp.rank * (self.in_features // per)
            copy_checked(param.data, mine.narrow(1, start, param.shape[1]))
        return load

    def _check_symmetric(self, param: nn.Parameter, loaded: Tensor,
                         shard_id: int | str | None = None) -> None:
        """sym: the stored zeros stand for 8 each (kept as no zero point)."""
        zeros = self._zero_rows(loaded)
        if not bool((zeros == 8).all()):
            raise ValueError(f"sym true but zero points other than 8 "
                             f"({sorted(set(zeros.unique().tolist()))[:8]})")

    def _load_g_idx(self, param: nn.Parameter, loaded: Tensor,
                    shard_id: int | str | None = None) -> None:
        k, group = self.whole_in_features, self.group_size
        _check(loaded, (k,), "g_idx (K,)")
        loaded = loaded.to(device=param.device, dtype=torch.int32)
        if not self.layout.act_order:
            ordered = torch.arange(k, device=loaded.device, dtype=torch.int32) // group
            if not torch.equal(loaded, ordered):
                raise ValueError("g_idx is not k // group_size, but desc_act is false")
            return
        if int(loaded.min()) < 0 or int(loaded.max()) >= k // group:
            raise ValueError(f"g_idx: groups 0 .. {k // group - 1} expected")
        if self.row_parallel:
            loaded = loaded.narrow(0, self.tp.rank * self.in_features, self.in_features)
        if bool((param.data == -1).all()):
            param.data.copy_(loaded)
        elif not torch.equal(param.data, loaded):
            raise ValueError("the parts of one fused linear (q/k/v or gate/up) have "
                             "different g_idx (act order); they must share one")

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, {self.layout.method}, "
                f"zero_point={not self.layout.symmetric}, act_order={self.layout.act_order}")
