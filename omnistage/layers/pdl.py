"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels of a decode step.

A kernel launched with PDL may start while the kernel before it in the stream is finishing; it
calls `gdc_wait()` before touching anything that kernel writes, and `gdc_launch_dependents()`
to let the kernel after it start early in turn. At one decode row a step is ~150 kernels of a
few microseconds, each waiting out the launch and ramp of the last: with PDL the matrix-vector
kernels fetch their weights during the previous kernels. Inside a kernel (PDL: 0 off, 1 or 2):

    if PDL == 2:
        gdc_launch_dependents()    # early launch: the next kernel may start now
    ...                            # loads of what no earlier kernel of the step writes
    if PDL:
        gdc_wait()                 # the previous kernel's writes are visible after this
    if PDL == 1:
        gdc_launch_dependents()

Nothing may be written before `gdc_wait()` (the output may reuse memory an earlier kernel
still reads), and every program calls it. With early launch (2) a chain of kernels runs ahead
as far as the multiprocessors hold their programs, each fetching its weights; a kernel's wait
returns once the one before it completed, which itself waited for its own predecessor, so
writes stay ordered. Early launch is per kind of kernel (`set_early_launch`; by default every
kind on an H100 or H200, none elsewhere: `early_kinds`). `gdc_wait` and
`gdc_launch_dependents` come from `triton.language.extra.cuda`. This module needs no triton
(the CUDA-graph capture asks it too). On CPU (Triton's interpreter) and GPUs before Hopper PDL
is off. A CUDA-graph capture that fails with it is retried without it.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from omnistage.utils.device import cuda_index, gpu_name

__all__ = ["KINDS", "early_kinds", "enabled", "is_enabled", "launch_options",
           "reset_early_launch", "set_early_launch", "set_enabled"]

_on = True
KINDS = frozenset({"gemv", "attention", "norm"})
# the kinds of kernel that let their dependents launch at their start; None: every kind on the
# GPUs where that measured faster (an H100 or H200), none elsewhere (early_kinds)
_early: frozenset[str] | None = None


def set_enabled(on: bool) -> None:
    """Switch PDL off (benchmarks measure both ways) or back on."""
    global _on
    _on = on


def is_enabled() -> bool:
    return _on


def set_early_launch(on: bool | frozenset[str] | set[str]) -> None:
    """Let each kernel's dependent launch as soon as this kernel starts (before its wait)
    rather than after its wait: the chain may run several kernels ahead, fetching weights.
    True: every kernel; a set: the kernels of those kinds (KINDS)."""
    global _early
    _early = KINDS if on is True else frozenset(on or ())


def reset_early_launch() -> None:
    """Back to the default: early launch where it measured faster."""
    global _early
    _early = None


def early_kinds(x: Tensor) -> frozenset[str]:
    """The kinds of kernel on x's device whose dependents launch at their start. By default
    every kind on an H100 or H200, where it measured faster: an H100's decoder layers took 706
    us a one-row step with early launch, the one-kernel attention and the matmul tiles swept
    that way, against 815 before (benchmarks/results/layers_pdl_early_h100.json); 8 and 64
    requests at once ran 8% and 12% faster with it (runs/pdl_early_h100/batches_*); an H200's
    single stream made 1397 tok/s with it against 1100-1106 with its layer kernel before
    (runs/pdl_early_h200/). Elsewhere none (not measured)."""
    if _early is not None:
        return _early
    name = gpu_name(x)
    return KINDS if "H100" in name or "H200" in name else frozenset()


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(x: Tensor) -> bool:
    """Whether kernels working on x launch with PDL."""
    if not (_on and x.is_cuda):
        return False
    return _capable(cuda_index(x.device))


def launch_options(x: Tensor, kind: str) -> dict[str, object]:
    """The PDL constexpr of a kernel of this kind (KINDS) and, when on, Triton's launch
    option: PDL 0 off, 1 dependents launch after the wait, 2 at the kernel's start."""
    if not enabled(x):
        return {"PDL": 0}
    return {"PDL": 2 if kind in early_kinds(x) else 1, "launch_pdl": True}
