"""The matrix-vector product of a few rows with a 4-bit weight (W4A16, layers/int4.py), the
weight read as packed int32 words and per-group scales and dequantized in registers: no
dequantized weight is ever written (CUDA; Triton's interpreter on CPU).

A decode step of a few rows reads every weight once and does little else; the per-call
dequantize of Int4Linear (layers/int4.py) writes and reads the whole weight again in the
activations' dtype, four times the packed bytes twice over. Here each program takes BLOCK_N
outputs and walks K in tiles of BLOCK_K = 8 * BLOCK_W inputs:

    words  (BLOCK_N, BLOCK_W) int32        W_packed[n, k / 8]
      -> nibbles (BLOCK_N, BLOCK_W, 8)     (word >> 4i) & 0xF, minus 8: q in [-8, 7]
    scales (BLOCK_N, BLOCK_W)              S[n, 8 (k / 8) / G]   (G a multiple of 8: a word
                                                                  never straddles two groups)
    w = (q * s rounded to S's dtype) rounded to x's dtype   (as dequantize_int4, then .to(x))
    acc[row, n] += sum over the tile of w * x[row, k]         (float32, every row at once)

so its numerics are the per-call path's weight and a float32 sum in another order. Each
program fetches its first tile before waiting on the previous kernel (pdl.py, kind "gemv").
Tile sizes are a first choice, not swept on a GPU yet.

A second kernel, triton_int4_split.py (K split across programs, the group scale applied once a
group, tiles per shape from a table), is "split" in KERNELS; this one is "rows". `linear`
takes "split" on the GPUs named in SPLIT_FASTER (the H200: a Qwen3-1.7B single stream 844
against 385 tok/s, benchmarks/results/runs/issue44_h200_s26/), "rows" elsewhere (no other GPU
measured yet); `set_kernel` and ar_offline --int4-kernel override that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from omnistage.layers import pdl, triton_int4_split
from omnistage.utils.device import gpu_name

MAX_ROWS = 4          # more rows: the per-call dequantize and one matmul (prefill)
KERNELS = ("rows", "split")
SPLIT_FASTER: tuple[str, ...] = ("H200",)   # GPU names where "split" is the default
_kernel: str | None = None             # set_kernel's choice; None: by SPLIT_FASTER


def set_kernel(name: str | None) -> None:
    """Which kernel `linear` takes (KERNELS), or None: the default (SPLIT_FASTER)."""
    global _kernel
    if name is not None and name not in KERNELS:
        raise ValueError(f"int4 kernel {name!r}: one of {KERNELS}")
    _kernel = name


def kernel_for(x: Tensor) -> str:
    """The kernel `linear` takes for x here."""
    if _kernel is not None:
        return _kernel
    name = gpu_name(x)
    return "split" if name and any(g in name for g in SPLIT_FASTER) else "rows"


def config(n: int, k: int) -> dict[str, int]:
    """BLOCK_N outputs a program (enough programs to fill an H200's 132 multiprocessors for
    N >= 1024), BLOCK_W words (8 * BLOCK_W inputs) a tile: 16 x 256 unpacked weights, 32
    float32 registers a thread in 4 warps. Not swept yet (benchmarks may replace it)."""
    block_w = min(32, max(8, triton.next_power_of_2(-(-k // 8))))
    return dict(BLOCK_N=8 if n <= 2048 else 16, BLOCK_W=block_w, num_warps=4, num_stages=2)


ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _round(x, TO: tl.constexpr):
    """float32 x rounded to bf16 (TO 1) or fp16 (TO 2), nearest even, kept in float32. bf16
    by its bits: Triton's interpreter truncates a float32 -> bf16 cast (the GPU rounds)."""
    if TO == 1:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536               # 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    elif TO == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _int4_gemv_kernel(X, P, S, B, Out, M, N, K, KW, stride_xm, stride_pn, stride_sn,
                      stride_om, GROUP: tl.constexpr, ROWS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, ROUND_S: tl.constexpr, ROUND_X: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                      PDL: tl.constexpr):
    if PDL == 2:
        gdc_launch_dependents()
    dt = X.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    j = tl.arange(0, BLOCK_W)                                             # word in the tile
    i = tl.arange(0, 8)                                                   # nibble in the word
    r = tl.arange(0, ROWS)
    p_rows = P + n[:, None].to(tl.int64) * stride_pn                      # (BLOCK_N, 1)
    s_rows = S + n[:, None].to(tl.int64) * stride_sn
    # the first tile (weights: never written by a kernel) before waiting on the previous one
    w_ok = n_ok[:, None] & (j < KW)[None, :]
    words = tl.load(p_rows + j[None, :], mask=w_ok, other=0)
    scales = tl.load(s_rows + (j * 8 // GROUP)[None, :], mask=w_ok, other=0.0)
    if PDL:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for w0 in range(0, KW, BLOCK_W):
        nxt = w0 + BLOCK_W + j
        nxt_ok = n_ok[:, None] & (nxt < KW)[None, :]
        words_next = tl.load(p_rows + nxt[None, :], mask=nxt_ok, other=0)
        scales_next = tl.load(s_rows + (nxt * 8 // GROUP)[None, :], mask=nxt_ok, other=0.0)
        q = ((words[:, :, None] >> (i * 4)[None, None, :]) & 0xF) - 8    # (BN, BW, 8)
        wf = q.to(tl.float32) * scales.to(tl.float32)[:, :, None]
        wf = _round(_round(wf, ROUND_S), ROUND_X)   # in the scales' dtype, then in x's
        k = (w0 + j)[:, None] * 8 + i[None, :]                            # (BW, 8)
        x_ptrs = X + r[:, None, None].to(tl.int64) * stride_xm + k[None, :, :]
        x = tl.load(x_ptrs, mask=(r < M)[:, None, None] & (k < K)[None, :, :], other=0.0)
        xf = x.to(tl.float32)                                             # (ROWS, BW, 8)
        for row in tl.static_range(ROWS):   # the weight tile is unpacked once for every row
            xi = tl.sum(tl.where(r[:, None, None] == row, xf, 0.0), 0)    # (BW, 8)
            part = tl.sum(tl.sum(wf * xi[None, :, :], 2), 1)              # (BLOCK_N,)
            acc += tl.where(r[:, None] == row, part[None, :], 0.0)
        words, scales = words_next, scales_next
    if HAS_BIAS:
        acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + r[:, None].to(tl.int64) * stride_om + n[None, :], acc.to(dt),
             mask=(r < M)[:, None] & n_ok[None, :])


def applies(x: Tensor, packed: Tensor, scale: Tensor, group_size: int) -> bool:
    """Whether the kernel takes x (rows, K): 1 to MAX_ROWS dense rows of a float dtype it
    rounds to, contiguous packed words, groups of whole words."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(-1) == 1
            and x.dtype in ROUNDING and scale.dtype in ROUNDING
            and packed.is_contiguous() and group_size % 8 == 0)


def linear(x: Tensor, packed: Tensor, scale: Tensor, group_size: int,
           bias: Tensor | None = None) -> Tensor:
    """x W^T (+ b) for x (rows, K) and W the (N, K) weight of `packed` (N, ceil(K / 8)) int32
    words and `scale` (N, ceil(K / G)); out (rows, N) in x's dtype."""
    if kernel_for(x) == "split" and triton_int4_split.applies(group_size):
        return triton_int4_split.linear(x, packed, scale, group_size, bias)
    rows, k = x.shape
    n, kw = packed.shape
    num_groups = -(-k // group_size)
    assert kw == -(-k // 8) and scale.shape == (n, num_groups), \
        (tuple(packed.shape), tuple(scale.shape), k, group_size)
    assert group_size % 8 == 0, f"group size {group_size}: not whole words"
    scale = scale.contiguous()
    cfg = config(n, k)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _int4_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, packed, scale, bias if bias is not None else x, out, rows, n, k, kw,
        x.stride(0), packed.stride(0), scale.stride(0), out.stride(0), GROUP=group_size,
        ROWS=triton.next_power_of_2(rows), HAS_BIAS=bias is not None,
        ROUND_S=ROUNDING[scale.dtype],
        ROUND_X=0 if x.dtype == scale.dtype else ROUNDING[x.dtype], **cfg,
        **pdl.launch_options(x, "gemv"))
    return out
