"""When the fused Triton kernels of triton_ops.py replace the PyTorch ops of norm.py,
activation.py and rotary.py: on CUDA tensors, where triton is installed, unless switched off.

    from omnistage.layers import fused
    ops = fused.ops_for(x)       # the triton_ops module, or None: use the PyTorch path
    fused.set_enabled(False)     # everything back to PyTorch (benchmarks measure both ways)

`norm_linear` and `silu_linear` run an RMSNorm (with its residual add) or a SiLU-and-mul and
the matmul after it, `linear` the matmul alone; a single row on CUDA (a single stream's decode
step) takes one matrix-vector kernel for both (triton_gemv.py; `set_gemv(False)`: cuBLAS).
A one-row decode step of a Qwen2/Qwen3 decoder can run each whole layer as one kernel
(triton_decoder_layer.py): by default where it measured faster than the kernels above (no
GPU since their early launch, pdl.py; the interpreter); `set_layer_kernel(True / False)`
forces it.

`set_decode_attention(True)` runs a small decode batch's attention (q/k norm, rotary, K/V store,
sliced attention, merge) as one kernel (triton_decode_attention.py; by default for one row
where the kernels launch early: an H100 or H200, pdl.py).

The PyTorch paths stay the reference on every device; tests compare the two.

Tensor parallelism (parallel.py): a matrix-vector kernel takes the rank's own weight rows or
columns; a row-parallel layer's result is then all-reduced (its bias in rank 0's part), an LM
head's gathered, as the layers' own forward does.
"""

from __future__ import annotations

from types import ModuleType

from torch import Tensor, nn

from omnistage.layers.parallel import ParallelLMHead, RowParallelLinear

_enabled = True
_gemv = True
_gemv_rows: int | None = None      # None: triton_gemv.max_rows (as measured on the GPU)
# Small decode batches: one attention kernel (triton_decode_attention.py). None: for one row
# where attention kernels launch early (pdl.py: an H100 or H200). An H100's layers took 628 us
# with it against 733 with the three kernels it replaces (benchmarks/results/runs/
# pdl_early_h100/); without early launch it was no faster (830 against 815 us).
_decode_attention: bool | None = None
_layer_kernel: bool | None = None   # None: where measured faster (triton_decoder_layer.py)
_interpret = False   # tests: the kernels on CPU tensors too (Triton's interpreter)
_ops: ModuleType | None | bool = False   # False: not looked up yet; None: triton missing


def set_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def is_enabled() -> bool:
    return _enabled


def set_gemv(enabled: bool) -> None:
    """Fused matrix-vector kernels for one-row decode steps (on by default)."""
    global _gemv
    _gemv = enabled


def set_gemv_rows(rows: int | None) -> None:
    """The most rows a matmul takes the fused kernels with (1: one-row steps only); None (the
    default): as measured fastest on the GPU (triton_gemv.max_rows)."""
    global _gemv_rows
    _gemv_rows = rows


def set_decode_attention(enabled: bool | None) -> None:
    """Small decode batches (split-K) take one kernel for q/k norm, rotary, the K/V store,
    attention and the merge of its slices: True always, False never, None (the default) for
    one row where the attention kernels launch early (pdl.early_kinds: an H100 or H200)."""
    global _decode_attention
    _decode_attention = enabled


def decode_attention_for(q: Tensor) -> bool:
    """Whether the decode batch of q (T, H, D) may take the one-kernel attention: its tensor-core
    products need D >= 16 (a tiny test model's heads of 8 take the per-op kernels)."""
    if q.shape[-1] < 16:
        return False
    if _decode_attention is not None:
        return _decode_attention
    from omnistage.layers import pdl

    return q.shape[0] == 1 and "attention" in pdl.early_kinds(q)


def set_layer_kernel(enabled: bool | None) -> None:
    """One kernel per decoder layer for one-row decode steps: True always, False never, None
    (the default) where it measured faster than the per-op kernels."""
    global _layer_kernel
    _layer_kernel = enabled


def layer_kernel_for(x: Tensor) -> ModuleType | None:
    """The one-kernel-a-layer module if a one-row step on x should use it, else None."""
    if _layer_kernel is False or not (_gemv and ops_for(x) is not None):
        return None
    from omnistage.layers import triton_decoder_layer

    if _layer_kernel is None and not triton_decoder_layer.faster_here(x):
        return None
    return triton_decoder_layer


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
    if not (_enabled and (x.is_cuda or _interpret)):
        return None
    return _load()


def _gemv_for(x: Tensor, weight: Tensor) -> ModuleType | None:
    if not (_gemv and ops_for(x) is not None):
        return None
    from omnistage.layers import triton_gemv

    return triton_gemv if triton_gemv.applies(x, weight, _gemv_rows) else None


def norm_linear(norm: nn.Module, linear: nn.Module, x: Tensor, residual: Tensor | None
                ) -> tuple[Tensor, Tensor]:
    """linear(norm(x + residual)) and the sum x + residual (x alone without a residual): what
    a pre-norm layer runs in front of its attention and its MLP. x, residual: (T, K)."""
    gemv = _gemv_for(x, linear.weight)
    if gemv is not None and norm.weight.dtype == x.dtype:
        scale = _eight_bit_scale(gemv, linear)
        out, total = gemv.norm_linear(x, residual, norm.weight, norm.eps, linear.weight,
                                      linear.bias, scale)
        return (out if scale is None else linear.finish(out)), total
    if residual is None:
        return linear(norm(x)), x
    normed, total = norm.add_forward(x, residual)
    return linear(normed), total


def linear(linear: nn.Module, x: Tensor) -> Tensor:
    """linear(x), through the matrix-vector kernel for one row where it runs."""
    gemv = _gemv_for(x, linear.weight)
    if gemv is not None:
        return _gemv_linear(gemv, linear, x, silu=False)
    return linear(x)


def lm_head(linear: nn.Module, x: Tensor) -> Tensor:
    """The logits projection: through the matrix-vector kernel for one row where that measured
    faster than cuBLAS (triton_gemv.lm_head_faster_here), else linear(x)."""
    gemv = _gemv_for(x, linear.weight)
    if gemv is not None and gemv.lm_head_faster_here(x):
        if isinstance(linear, ParallelLMHead):
            return linear.gather(gemv.linear(x, linear.weight, None))
        return gemv.linear(x, linear.weight, linear.bias)
    return linear(x)


def silu_linear(act: nn.Module, linear: nn.Module, x: Tensor) -> Tensor:
    """linear(act(x)) for x (T, 2I) laid out | gate | up | and act the SiLU-and-mul."""
    gemv = _gemv_for(x, linear.weight)
    if gemv is not None:
        return _gemv_linear(gemv, linear, x, silu=True)
    return linear(act(x))


def _eight_bit_scale(gemv: ModuleType, linear: nn.Module) -> Tensor | None:
    """An 8-bit linear's weight scale (layers/fp8.py Fp8Linear, layers/int8.py Int8Linear:
    the matrix-vector kernel reads its e4m3 / int8 weight and scales the sums; then `finish`
    does its tensor-parallel part), else None."""
    return linear.weight_scale if linear.weight.dtype in gemv.SCALED_WEIGHTS else None


def _gemv_linear(gemv: ModuleType, linear: nn.Module, x: Tensor, silu: bool) -> Tensor:
    """The kernel's x W^T (+ b), with SiLU-and-mul in front if `silu`; a row-parallel layer's
    partial result all-reduced, its bias in rank 0's part only (RowParallelLinear.forward)."""
    run = gemv.silu_linear if silu else gemv.linear
    scale = _eight_bit_scale(gemv, linear)
    if scale is not None:       # an 8-bit linear: its weight read with its scale
        return linear.finish(run(x, linear.weight, linear.bias, scale))
    if isinstance(linear, RowParallelLinear):
        return linear.reduce(run(x, linear.weight, linear.local_bias))
    return run(x, linear.weight, linear.bias)
