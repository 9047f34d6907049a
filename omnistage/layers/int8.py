"""INT8 W8A8 linears (issue 44): int8 weights with one scale per output channel, quantized
once from the bf16 / fp32 checkpoint after it has loaded, and int8 activations with one scale
per token, computed on every call. One `torch._int_mm` per layer (int32 accumulation, on the
CPU and on CUDA GPUs of any recent generation, unlike FP8), then the two scales:

    x (M, K)  -> per-token amax / 127 -> xq (M, K) int8, sx (M, 1) fp32
    W (N, K)  -> per-row amax / 127   -> Wq (N, K) int8, sw (1, N) fp32   (once, at load)
    y = _int_mm(xq, Wq^T) (M, N) int32 * sx * sw  (+ b), in x's dtype

Wq is kept (N, K) row-major and handed to `_int_mm` as its column-major (K, N) view, the layout
cuBLAS' int8 kernels take: with a row-major (K, N) copy `_int_mm` ran 5.6-7.8x slower on an
H200 at Qwen-Image's shapes (0.64 against 0.11 ms at 4096 x 3072 x 3072; session 28's
runs/issue44_h200_s28/int8_mm.json), and the one-row kernel reads (N, K) as it reads FP8.

Symmetric, round to nearest, no zero point: an activation row with one outlier spends its
levels on it (the SmoothQuant problem); the error this costs on a tiny FLUX / Qwen-Image is
measured in tests/golden/layers/test_int8.py and docs/quantization.md.

On CUDA both steps are Triton kernels instead (layers/triton_int8.py: the quantization in one
pass, the int8 tensor-core matmul with the scales and the bias in its epilogue): on an H200 at
Qwen-Image's shapes 0.93-1.18x bf16's F.linear, where `_int_mm` between the PyTorch chains ran
at 0.30x (runs/issue44_h200_s28/int8_gemm.json). The tests find the kernels' quantization
bit for bit the PyTorch form's; at those shapes the benchmark found some values differing
(not located), the outputs within 0.5% of the largest and the image's PSNR unchanged.

Which layers: those `quantize_fp8` would take (layers/fp8.py: the model's `fp8_keep` patterns,
K or N below `min_features`, sides not a multiple of 16 stay as they are); a model without an
`fp8_keep` policy (a text encoder) keeps none by name. CUDA's `_int_mm` needs M > 16: fewer
rows are padded with zeros. One row (a single stream's decode step) goes instead through the
matrix-vector kernel of layers/fused.py with the int8 weight and its scales (W8A16: the row is
not quantized), where the W8A8 path above ran at 0.073x bf16's decode (H200).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers import fused
from omnistage.layers.fp8 import MIN_FEATURES, shard_of, swap_linears
from omnistage.layers.parallel import (TPGroup, all_gather_last, all_reduce)

INT8_MAX = 127.0
CUDA_MIN_ROWS = 17          # torch._int_mm on CUDA: M > 16


def quantize_rows_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (M, K) -> (q (M, K) int8, scale (M, 1) float32), x ~= q * scale row by row."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / INT8_MAX
    return (x.float() / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def int8_matmul(xq: Tensor, sx: Tensor, wq_t: Tensor, sw: Tensor) -> Tensor:
    """(xq * sx) @ (wq_t * sw) in float32: xq (M, K), sx (M, 1), wq_t (K, N) (best the
    column-major view of an (N, K) matrix), sw (1, N)."""
    m = xq.shape[0]
    if xq.is_cuda and m < CUDA_MIN_ROWS:
        xq = F.pad(xq, (0, 0, 0, CUDA_MIN_ROWS - m))
    return torch._int_mm(xq, wq_t)[:m].float() * sx * sw


@torch.library.custom_op("omnistage::int8_linear", mutates_args=())
def _int8_linear_kernels(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None
                         ) -> Tensor:
    """x (M, K) -> (M, N) in x's dtype: the rows quantized, the int8 matmul with the scales and
    the bias in its epilogue (layers/triton_int8.py); an opaque op to torch.compile."""
    from omnistage.layers import triton_int8
    xq, sx = triton_int8.quantize_rows_int8(x)
    return triton_int8.int8_matmul(xq, sx, weight, scale, bias, out_dtype=x.dtype)


@_int8_linear_kernels.register_fake
def _(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


class Int8Linear(nn.Module):
    """y = x W^T (+ b), W int8 (per output channel scales), x quantized per token. Keeps the
    tensor-parallel duties of the layer it replaces, as Fp8Linear does."""

    def __init__(self, weight: Tensor, bias: Tensor | None, tp: TPGroup,
                 gather_output: bool = False, reduce_results: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape                 # this rank's shard
        self.tp, self.gather_output, self.reduce_results = tp, gather_output, reduce_results
        wq, scale = quantize_rows_int8(weight.detach())
        self.register_buffer("weight", wq.contiguous())                    # (N, K) int8
        self.register_buffer("weight_scale", scale.t().contiguous())      # (1, N) float32
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @classmethod
    def from_linear(cls, linear: nn.Module) -> Int8Linear:
        """The INT8 form of one of `LINEARS` (its local shard, with its bias as it adds it)."""
        weight, bias, tp, kw = shard_of(linear)
        return cls(weight, bias, tp, **kw)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        if fused.ops_for(x) is not None:            # CUDA: two Triton kernels (triton_int8.py)
            y = _int8_linear_kernels(rows, self.weight, self.weight_scale, self.bias)
            return self.finish(y.unflatten(0, x.shape[:-1]))
        xq, sx = quantize_rows_int8(rows)                                   # (M, K), (M, 1)
        y = int8_matmul(xq, sx, self.weight.t(), self.weight_scale)          # (M, N) float32
        if self.bias is not None:
            y = y + self.bias
        return self.finish(y.to(x.dtype).unflatten(0, x.shape[:-1]))

    def finish(self, y: Tensor) -> Tensor:
        """This rank's product (bias included) combined as the replaced layer did (fused.py
        calls it after its matrix-vector kernel)."""
        if self.reduce_results:
            y = all_reduce(y, self.tp)
        return all_gather_last(y, self.tp) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def quantize_int8(model: nn.Module, min_features: int = MIN_FEATURES,
                  keep: tuple[str, ...] | None = None) -> list[str]:
    """Swap the model's eligible linears for Int8Linear in place (the module docstring says
    which; `keep`, when given, instead of the model's `fp8_keep`); returns the names swapped.
    The bf16 / fp32 weights are dropped with the layers."""
    keep = getattr(model, "fp8_keep", ()) if keep is None else keep
    return swap_linears(model, Int8Linear.from_linear, keep, min_features)
