"""When the fused Triton kernels of triton_ops.py replace the PyTorch ops of norm.py,
activation.py and rotary.py: on CUDA tensors, where triton is installed, unless switched off.

    from omnistage.layers import fused
    ops = fused.ops_for(x)       # the triton_ops module, or None: use the PyTorch path
    fused.set_enabled(False)     # everything back to PyTorch (benchmarks measure both ways)

The PyTorch paths stay the reference on every device; tests compare the two.
"""

from __future__ import annotations

from types import ModuleType

from torch import Tensor

_enabled = True
_ops: ModuleType | None | bool = False   # False: not looked up yet; None: triton missing


def set_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def is_enabled() -> bool:
    return _enabled


def _load() -> ModuleType | None:
    global _ops
    if _ops is False:
        try:
            from omnistage.layers import triton_ops
        except ImportError:
            _ops = None
        else:
            _ops = triton_ops
    return _ops  # type: ignore[return-value]


def ops_for(x: Tensor) -> ModuleType | None:
    """The fused kernels if they should run on x, else None."""
    if not (_enabled and x.is_cuda):
        return None
    return _load()
