"""INT8 W8A8 matmul with its scales fused, and the per-token activation quantization in front
of it (CUDA; Triton's interpreter on CPU), for the diffusion transformers' INT8 linears
(layers/int8.py, issue 44).

Int8Linear's eager form runs `torch._int_mm` between two chains of PyTorch kernels: the
activation quantization (abs, amax, divide, round, clamp, cast: 0.2-1.4 ms on an H200 at
Qwen-Image's shapes) and the epilogue (int32 -> float32, * sx, * sw, + bias, -> bf16: another
0.1-1 ms, each step a pass over the (M, N) output in float32). Here they are two kernels:

    quantize_rows_int8   x (M, K) -> q (M, K) int8, scale (M, 1) float32, one row a program:
                         scale = max(amax |x_row|, 1e-12) / 127, q = round(x / scale) (one
                         read of x, one write of q: int8.py's PyTorch form, bit for bit)
    int8_matmul          y = ((xq @ w^T) as int32 -> float32) * sx * sw (+ bias) -> out dtype

int8_matmul tiles the output, each program owning one (BLOCK_M, BLOCK_N) tile and walking K:

            K ->                           w (N, K) int8, K contiguous
    xq  | a a a a |            acc (BLOCK_M, BLOCK_N) int32 += tl.dot(a, b^T) over K tiles
   (M,K)| . . . . |    b^T: (BLOCK_K, BLOCK_N) read along K, the layout of Hopper's int8
        | . . . . |         wgmma (both operands K-major; int8 has no transposed form)

then, in registers: acc as float32, * sx[row], * sw[col], + bias[col], one rounding to the
output dtype, in int8.py's order (its eager epilogue's float32 operations; on the GPU the
last product and the bias add compile to one fma, a rounding fewer). Rows
past M and columns past N read row M-1 / column N-1 again (loads unmasked, stores masked);
K tiles past K are masked only where K is not a multiple of BLOCK_K. Programs run in groups of
GROUP_M row tiles per column tile, so a group's B tiles are still in L2 when the next row tile
needs them. A second form of the same kernel (cfg TMA=1, Hopper and newer: sm_90+) reads the
tiles and writes the output through TMA tensor descriptors instead of pointers: TMA zero-fills
past the edges and clips the store, and frees the registers address arithmetic takes (234
against 254 a thread at 128 x 256, 104 against 156 at 128 x 128, ptxas for sm_90). Which is
faster on an H200 is for the sweep to say; the pointer form is the default (any GPU).

Tiles come from `config(m, n, k)`, a fixed table (no autotuning: it would benchmark at the
first call, inside a server's first request or a CUDA graph capture); `int8_matmul(cfg=...)`
overrides it (benchmarks/kernels/int8_gemm.py --sweep). Rounding half to even is done with
float32's 1.5 * 2^23 trick: libdevice's rint is not in Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

INT8_MAX = tl.constexpr(127.0)
ROUND_MAGIC = tl.constexpr(12582912.0)   # 1.5 * 2^23: (v + it) - it = v rounded, |v| < 2^22
MAX_ROW_BLOCK = 16384         # a longer row is quantized in tiles of this many (two passes)


@triton.jit
def _rint(v):
    """v rounded to the nearest integer, half to even (as torch.round), |v| < 2^22: v + 1.5 *
    2^23 lands where float32's spacing is 1, so the add rounds it (IEEE adds round to even).
    Neither Triton nor ptxas reassociates the two adds (PTX for sm_90: both kept)."""
    return (v + ROUND_MAGIC) - ROUND_MAGIC


@triton.jit
def _quantize_rows_int8_kernel(X, Q, S, stride_x, stride_q, N, BLOCK: tl.constexpr,
                               NUM_TILES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = X + row * stride_x
    q_row = Q + row * stride_q
    if NUM_TILES == 1:        # the row stays in registers between the two passes
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
    else:
        amax = tl.zeros((), tl.float32)
        for t in range(NUM_TILES):
            c = t * BLOCK + cols
            xt = tl.load(x_row + c, mask=c < N, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(xt), axis=0))
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), INT8_MAX)      # IEEE /, as torch
    for t in range(NUM_TILES):
        c = t * BLOCK + cols
        if NUM_TILES > 1:
            x = tl.load(x_row + c, mask=c < N, other=0.0).to(tl.float32)
        q = _rint(tl.math.div_rn(x, scale))
        q = tl.minimum(tl.maximum(q, -INT8_MAX), INT8_MAX)
        tl.store(q_row + c, q.to(tl.int8), mask=c < N)
    tl.store(S + row, scale)


def quantize_rows_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (M, K) float (rows may be strided, the last dim contiguous) -> (q (M, K) int8,
    scale (M, 1) float32), x ~= q * scale row by row: layers/int8.py's quantize_rows_int8
    (round half to even, clamp to +-127) in one pass over x."""
    assert x.dim() == 2, f"x {tuple(x.shape)}: (M, K)"
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(MAX_ROW_BLOCK, triton.next_power_of_2(k))
        _quantize_rows_int8_kernel[(m,)](
            x, q, scale, x.stride(0), q.stride(0), k, BLOCK=block,
            NUM_TILES=triton.cdiv(k, block), num_warps=min(16, max(4, block // 512)))
    return q, scale


@triton.jit
def _tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program -> (row tile, column tile): GROUP_M row tiles walk each column tile in turn."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


# M is the token count: specialising on it (divisible by 16 or not, or 1) would build another
# variant mid-serving for some prompt lengths
@triton.jit(do_not_specialize=["M"])
def _int8_matmul_kernel(A, B, SA, SB, Bias, C, M, N, K, stride_am, stride_bn, stride_cm,
                        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    am = tl.minimum(rm, M - 1)     # edge tiles read the last row / column again: loads
    bn = tl.minimum(rn, N - 1)     # unmasked along M and N (stores are masked)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = A + am[:, None].to(tl.int64) * stride_am + rk[None, :]       # (BM, BK)
    b_ptrs = B + bn[None, :].to(tl.int64) * stride_bn + rk[:, None]       # (BK, BN) K-major
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=rk[None, :] < K - k0, other=0)
            b = tl.load(b_ptrs, mask=rk[:, None] < K - k0, other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    # int8.py's epilogue, in its order: float32(acc) * sx * sw (+ bias), rounded once
    # (exact int32 -> float32 below 2^24, as `.float()`; * sw and + bias: one fma on the GPU)
    sa = tl.load(SA + am)
    sb = tl.load(SB + bn)
    y = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        y = y + tl.load(Bias + bn).to(tl.float32)[None, :]
    c_ptrs = C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, y.to(C.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _int8_matmul_tma_kernel(A, B, C, SA, SB, Bias, M, N, K, HAS_BIAS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """The same through tensor descriptors (A, B, C: Hopper's TMA copies whole tiles into
    shared memory, zeros past the edges, and clips the stored tile; no address arithmetic
    in registers)."""
    pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        a = A.load([off_m, k0])                                            # (BM, BK)
        b = B.load([off_n, k0])                                            # (BN, BK)
        acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    sa = tl.load(SA + rm, mask=rm < M, other=0.0)
    sb = tl.load(SB + rn, mask=rn < N, other=0.0)
    y = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        y = y + tl.load(Bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    C.store([off_m, off_n], y.to(C.dtype))


def config(m: int, n: int, k: int) -> dict[str, int]:
    """Tile sizes and launch options for (M, N, K): a first choice, not swept on a GPU yet.

    Large M: 128 x 256 output tiles, K in 128-byte steps, 8 warps (two warpgroups of Hopper's
    int8 wgmma, 128 int32 accumulators a thread), 3 stages of 48 KiB in shared memory: FP8's
    usual Hopper tile (int8 and e4m3 are both a byte). Fewer tiles than an H100/H200 has
    multiprocessors (132): 128 x 128, twice the programs. M <= 64: rows of 16 / 32 / 64
    (below 64 Triton takes mma.sync, not wgmma), narrower columns, 4 warps, 4 stages."""
    block_k = 128 if k >= 128 else max(32, triton.next_power_of_2(k))  # int8 dot: K >= 32
    if m <= 64:
        block_m = max(16, triton.next_power_of_2(m))
        block_n = 64 if m <= 16 else 128
        return dict(BLOCK_M=block_m, BLOCK_N=min(block_n, _cols(n)), BLOCK_K=block_k,
                    GROUP_M=8, num_warps=4, num_stages=4)
    block_n = 256 if triton.cdiv(m, 128) * triton.cdiv(n, 256) >= 132 else 128
    return dict(BLOCK_M=128, BLOCK_N=min(block_n, _cols(n)), BLOCK_K=block_k, GROUP_M=8,
                num_warps=8, num_stages=3)


def _cols(n: int) -> int:
    """The widest column tile worth having for N columns (a power of two, >= 16)."""
    return max(16, triton.next_power_of_2(n))


def int8_matmul(xq: Tensor, sx: Tensor, w: Tensor, sw: Tensor, bias: Tensor | None = None,
                out_dtype: torch.dtype = torch.bfloat16, cfg: dict[str, int] | None = None
                ) -> Tensor:
    """((xq @ w^T) in int32, as float32) * sx * sw (+ bias), rounded once to out_dtype:
    xq (M, K) int8 and w (N, K) int8 both K-contiguous, sx (M, 1) float32, sw (N,) or (1, N)
    float32, bias (N,) float or None -> (M, N). K and N multiples of 16, any M; `cfg`
    replaces `config(M, N, K)` (its keys, and TMA: 1 for the descriptor kernel: sm_90+,
    xq, w and the output 16-byte aligned)."""
    m, k = xq.shape
    n = w.shape[0]
    assert xq.dtype == w.dtype == torch.int8 and w.shape == (n, k), \
        (xq.dtype, w.dtype, tuple(xq.shape), tuple(w.shape))
    assert xq.stride(-1) == 1 and w.stride(-1) == 1, (xq.stride(), w.stride())
    assert n % 16 == 0 and k % 16 == 0, f"N {n}, K {k}: multiples of 16"
    sx = sx.reshape(-1).float().contiguous()
    sw = sw.reshape(-1).float().contiguous()
    assert sx.numel() == m and sw.numel() == n, (tuple(sx.shape), tuple(sw.shape), m, n)
    assert bias is None or bias.numel() == n, (tuple(bias.shape), n)
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    cfg = dict(config(m, n, k) if cfg is None else cfg)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    bias_arg = sx if bias is None else bias.reshape(-1).contiguous()
    if cfg.pop("TMA", 0):
        _int8_matmul_tma_kernel[grid](
            TensorDescriptor.from_tensor(xq, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
            TensorDescriptor.from_tensor(out, [bm, bn]), sx, sw, bias_arg, m, n, k,
            HAS_BIAS=bias is not None, **cfg)
        return out
    _int8_matmul_kernel[grid](
        xq, w, sx, sw, bias_arg, out, m, n, k, xq.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, **cfg)
    return out
