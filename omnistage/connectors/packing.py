"""Tensors <-> one flat byte buffer: the layout every connector shares.

    offset 0          meta[1].offset          meta[2].offset
    | t0 bytes | pad  | t1 bytes | pad        | t2 bytes |        each tensor starts at a
    ^                 ^                       ^                   multiple of ALIGNMENT bytes

A tensor's bytes are its elements in row-major (contiguous) order. `TensorMeta` carries the name,
the dtype name ("bfloat16"), the shape, the offset and the byte count, so a reader rebuilds the
tensor as `buf[offset:offset + nbytes].view(dtype).view(shape)`. Everything goes through torch
dtypes and uint8 views (numpy has no bfloat16); nothing is pickled. Alignment keeps every
`.view(dtype)` legal and lets readers on the other side use vector loads.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from omnistage.connectors.base import TensorMeta

ALIGNMENT = 64


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """"bfloat16" -> torch.bfloat16; a ValueError for anything that is not a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"connector: unknown dtype name {name!r}")
    return dtype


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def plan(tensors: Mapping[str, Tensor]) -> tuple[list[TensorMeta], int]:
    """Lay the tensors out in one buffer; returns their metas and the buffer size in bytes."""
    metas: list[TensorMeta] = []
    cursor = 0
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise ValueError(f"connector: payload entry {name!r} is a {type(t).__name__}, "
                             "not a torch.Tensor")
        if t.layout != torch.strided or t.is_quantized:
            raise ValueError(f"connector: payload entry {name!r} has layout {t.layout}; "
                             "only dense tensors can be moved")
        offset = align_up(cursor)
        nbytes = t.numel() * t.element_size()
        metas.append(TensorMeta(name=name, dtype=dtype_name(t.dtype), shape=list(t.shape),
                                offset=offset, nbytes=nbytes))
        cursor = offset + nbytes
    return metas, cursor


def slot(buf: Tensor, meta: TensorMeta) -> Tensor:
    """The tensor `meta` describes, as a view into the uint8 buffer `buf` (no copy)."""
    end = meta.offset + meta.nbytes
    assert buf.dtype == torch.uint8 and buf.dim() == 1, (buf.dtype, buf.shape)
    assert end <= buf.numel(), (meta.name, end, buf.numel())
    return buf[meta.offset:end].view(dtype_from_name(meta.dtype)).view(meta.shape)


def write(buf: Tensor, tensors: Mapping[str, Tensor], metas: list[TensorMeta]) -> None:
    """Copy each tensor into its slot of `buf`; a non-contiguous or CUDA source is copied straight
    into place, with no intermediate contiguous or host copy."""
    assert len(metas) == len(tensors), (len(metas), len(tensors))
    for meta in metas:
        src = tensors[meta.name].detach()
        assert list(src.shape) == meta.shape, (meta.name, list(src.shape), meta.shape)
        if meta.nbytes:
            slot(buf, meta).copy_(src)


def read(buf: Tensor, metas: list[TensorMeta],
         device: torch.device | str | None = None) -> dict[str, Tensor]:
    """Copy each tensor out of `buf` into fresh memory (on `device`, default CPU)."""
    target = torch.device("cpu" if device is None else device)
    out: dict[str, Tensor] = {}
    for meta in metas:
        view = slot(buf, meta)
        # .to() on the same device returns the view itself: clone so nothing aliases `buf`
        out[meta.name] = view.clone() if target.type == "cpu" else view.to(target)
    return out


def pack(tensors: Mapping[str, Tensor]) -> tuple[list[TensorMeta], Tensor]:
    """Plan and write into a fresh CPU uint8 buffer; returns the metas and the buffer."""
    metas, nbytes = plan(tensors)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    write(buf, tensors, metas)
    return metas, buf
