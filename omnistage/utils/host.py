"""Host-side tensors built fast from Python ints (the per-step inputs of the engines)."""

from __future__ import annotations

import array
from typing import Iterable, Sequence

import torch
from torch import Tensor

_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def int_tensor(values: Iterable[int], dtype: torch.dtype = torch.int64) -> Tensor:
    """A 1-D CPU tensor of `values` (int64 or int32). Through `array.array` it is several times
    faster than `torch.tensor` on a list, which converts element by element (20 us for the 200
    ints of a decode step's inputs); the tensor holds the array's memory alive."""
    return array_tensor(int_array(values, dtype))


def int_array(values: Iterable[int], dtype: torch.dtype = torch.int64) -> array.array:
    """`values` as C ints (int64 or int32): what `int_tensor` wraps. Pickled, it is its bytes
    (a few us for 64 KiB, where a tensor takes 80 us and a list of ints 700)."""
    return array.array(_TYPECODES[dtype], values)


def array_tensor(buf: array.array) -> Tensor:
    """A 1-D CPU tensor over `buf`'s memory (no copy; it keeps `buf` alive)."""
    dtype = torch.int64 if buf.typecode == "q" else torch.int32
    if not buf:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype)


def int_matrix(rows: Sequence[Sequence[int]], width: int, dtype: torch.dtype = torch.int32,
               fill: int = 0) -> Tensor:
    """(len(rows), width) CPU tensor of rows padded with `fill` (block tables)."""
    return array_tensor(int_matrix_array(rows, width, dtype, fill)).view(len(rows), width)


def int_matrix_array(rows: Sequence[Sequence[int]], width: int,
                     dtype: torch.dtype = torch.int32, fill: int = 0) -> array.array:
    """The rows of `int_matrix`, flattened into an `int_array`."""
    flat: list[int] = []
    for r in rows:
        flat += r
        flat += [fill] * (width - len(r))
    return int_array(flat, dtype)


def to_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """A small host list as a tensor on `device`, copied without waiting for the device: a
    plain `torch.tensor(..., device=cuda)` waits for every kernel queued before it (with async
    scheduling, the next step's too). Pinned memory, non-blocking copy on CUDA."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
