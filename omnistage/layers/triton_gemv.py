"""Matrix-vector products for decode steps of a few rows, with the small op in front fused in
(CUDA; Triton's interpreter on CPU). Experimental: off unless `fused.set_gemv(True)`.

At one to a few rows a decode step's matmuls read their weights once and do little else, and
the step is bound by the number of kernels per layer, each a few microseconds (see the README's
benchmarks). These kernels fold the op in front of a matmul into its prologue:

    norm_linear    (x [+ residual]) -> RMSNorm -> x W^T      (add+norm kernel and matmul -> 1)
    silu_linear    | gate | up | -> silu(gate) * up -> x W^T  (SiLU kernel and matmul -> 1)

One program per (row, block of BLOCK_N outputs) walks K in BLOCK_K tiles: W rows are read
along K (contiguous), the activation tile is recomputed from the input in every program (K
values: kilobytes, from L2), products are summed in float32. A norm's inverse RMS needs the
whole row first: a program makes one pass over the row for it, then one with the weights. With
a residual, program 0 of each row also writes the sum (the next layer's residual).

Numerics as the unfused ops (triton_ops.py, HF's modules): the residual sum, the normalised
value, the norm's product and silu(gate) and its product are each rounded to the input dtype;
the matmul accumulates in float32 like cuBLAS, in another order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_ROWS = 4          # more rows: cuBLAS (a matmul, where weights are reused across rows)
BLOCK_N = 16
BLOCK_K = 256


@triton.jit
def _gemv_kernel(X, R, NW, W, B, Out, Sum, N, K, eps,
                 stride_xm, stride_rm, stride_wn, stride_om, stride_sm,
                 NORM: tl.constexpr, ADD: tl.constexpr, SILU: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    dt = X.dtype.element_ty
    x_row = X + row * stride_xm
    r_row = R + row * stride_rm
    if NORM:   # pass 1: the row's inverse RMS (and, with a residual, its sum, by program 0)
        ss = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_row + k, mask=k_ok, other=0.0)
            if ADD:
                x = (x.to(tl.float32) + tl.load(r_row + k, mask=k_ok, other=0.0
                                                ).to(tl.float32)).to(dt)
                if pid_n == 0:
                    tl.store(Sum + row * stride_sm + k, x, mask=k_ok)
            xf = x.to(tl.float32)
            ss += xf * xf
        inv = tl.rsqrt(tl.sum(ss, 0) / K + eps)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        if SILU:
            gate = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
            up = tl.load(x_row + K + k, mask=k_ok, other=0.0).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
            x = (act * up).to(dt)
        else:
            x = tl.load(x_row + k, mask=k_ok, other=0.0)
            if ADD:
                x = (x.to(tl.float32) + tl.load(r_row + k, mask=k_ok, other=0.0
                                                ).to(tl.float32)).to(dt)
        if NORM:
            nw = tl.load(NW + k, mask=k_ok, other=0.0).to(tl.float32)
            x = ((x.to(tl.float32) * inv).to(dt).to(tl.float32) * nw).to(dt)
        w = tl.load(W + n[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)          # (BLOCK_N, BLOCK_K)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    if HAS_BIAS:
        acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_om + n, acc.to(Out.dtype.element_ty), mask=n_ok)


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether these kernels take a matmul of x (rows, K): few rows, one dtype, dense rows."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == weight.dtype
            and x.stride(-1) == 1 and weight.is_contiguous())


def _launch(x: Tensor, residual: Tensor | None, norm_weight: Tensor | None, eps: float,
            weight: Tensor, bias: Tensor | None, silu: bool, in_features: int
            ) -> tuple[Tensor, Tensor | None]:
    rows, n = x.shape[0], weight.shape[0]
    assert weight.shape[1] == in_features, (weight.shape, in_features)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    total = torch.empty(rows, in_features, dtype=x.dtype, device=x.device) \
        if residual is not None else None
    r = residual if residual is not None else x
    s = total if total is not None else out
    _gemv_kernel[(triton.cdiv(n, BLOCK_N), rows)](
        x, r, norm_weight if norm_weight is not None else weight, weight,
        bias if bias is not None else weight, out, s, n, in_features, eps,
        x.stride(0), r.stride(0), weight.stride(0), out.stride(0), s.stride(0),
        NORM=norm_weight is not None, ADD=residual is not None, SILU=silu,
        HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return out, total


def norm_linear(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """s = x + residual (x alone without one); returns (rms_norm(s) W^T + b, s).
    x, residual: (rows, K); weight (N, K)."""
    out, total = _launch(x, residual, norm_weight, eps, weight, bias, False, x.shape[1])
    return out, (total if total is not None else x)


def silu_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (rows, 2I) laid out | gate | up | -> (silu(gate) * up) W^T + b, (rows, N)."""
    out, _ = _launch(x, None, None, 0.0, weight, bias, True, x.shape[1] // 2)
    return out
