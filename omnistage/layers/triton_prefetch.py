"""Prefetching weights into L2 ahead of the kernel that reads them (Hopper and later).

A one-row decode step reads ~30 MB of weights a layer in a chain of short matmuls; each one
pays the memory's latency before its bytes flow, and between kernels memory sits idle. A
kernel that knows which weights come next can ask for them now: `l2_prefetch` issues bulk
prefetches (`cp.async.bulk.prefetch.L2`, sm_90: the copy engine fetches a range into L2, no
registers, no completion to wait for), so memory keeps streaming while the current matmul
runs and the next one reads from L2. Weights are never written: prefetching them is always
safe. The matmul kernels (triton_gemv.py, triton_decoder_layer.py) take a target each;
`fused.chain_l2_prefetch` says which.

The interpreter cannot run PTX: kernels take the prefetch only on CUDA (`supported`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def l2_prefetch(P, numel, part, parts, LANES: tl.constexpr):
    """Part `part` of `parts` of the numel elements at P into L2, as LANES bulk prefetches of
    at least 16 bytes each (LANES = the program's threads: one each)."""
    es: tl.constexpr = P.dtype.element_ty.primitive_bitwidth // 8
    step: tl.constexpr = 16 // es                   # elements in 16 bytes (the unit)
    per = tl.cdiv(tl.cdiv(numel, parts * LANES), step) * step
    start = (part * LANES + tl.arange(0, LANES)).to(tl.int64) * per
    size = (tl.minimum(tl.maximum(numel - start, 0), per) * es).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [P + start, size], dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.cache
def num_sms(index: int) -> int:
    """Multiprocessors of CUDA device `index`."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def supported(x: Tensor) -> bool:
    """Whether kernels on x's device can prefetch (CUDA, Hopper or later)."""
    return x.is_cuda and _capable(x.device.index if x.device.index is not None
                                  else torch.cuda.current_device())


def usable(t: Tensor | None) -> bool:
    """A prefetch target must be dense and 16-byte aligned, a multiple of 16 bytes long."""
    return (t is not None and t.is_contiguous() and t.data_ptr() % 16 == 0
            and t.numel() * t.element_size() % 16 == 0)
