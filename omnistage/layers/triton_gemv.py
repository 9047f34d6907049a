"""Matrix-vector products for one-row decode steps, with the small op in front fused in
(CUDA; Triton's interpreter on CPU). On by default for one row (a single stream's decode
step); `fused.set_gemv(False)` turns them off.

At one row a decode step's matmuls read their weights once and do little else, and
the step is bound by the number of kernels per layer, each a few microseconds (see
docs/benchmarks.md). These kernels fold the op in front of a matmul into its prologue:

    norm_linear    (x [+ residual]) -> RMSNorm -> x W^T      (add+norm kernel and matmul -> 1)
    silu_linear    | gate | up | -> silu(gate) * up -> x W^T  (SiLU kernel and matmul -> 1)
    linear         x W^T (cuBLAS' choice for one row of some shapes streams at a third of
                   the memory bandwidth: too few programs)

Each takes an 8-bit weight too, FP8 (e4m3) or INT8, with its per-output-channel (or
per-tensor) scale: the tile is widened to float32 as it is read and the sums scaled before the
bias (W8A16: the activations stay in their dtype). A decode step reads every weight once, so
8-bit weights halve its bytes, where W8A8 through torch._scaled_mm (layers/fp8.py) or
torch._int_mm (layers/int8.py: 0.073x bf16's decode on an H200, padded to 17 rows) spent more
on quantizing one row's activations and on a kernel made for large matrices than it saved.

One program per block of BLOCK_N outputs walks K in BLOCK_K tiles for every row at once: W
rows are read along K (contiguous) once, the activation tile is recomputed from the input in
every program (K values: kilobytes, from L2), products are summed in float32. A norm's inverse
RMS needs the whole row first: a program makes one pass over the row for it, then one with the
weights. With a residual, program 0 also writes the sum (the next layer's residual). Each
program fetches its first weight tile before waiting on the previous kernel (pdl.py).

Numerics as the unfused ops (triton_ops.py, HF's modules): the residual sum, the normalised
value, the norm's product and silu(gate) and its product are each rounded to the input dtype;
the matmul accumulates in float32 like cuBLAS, in another order.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from torch import Tensor

from omnistage.layers import pdl
from omnistage.utils.device import gpu_name

# One row everywhere. On an H200 (benchmarks/results/sweep_gemv_qwen3-0.6b*.json), one row
# through Qwen3-0.6B's four decode matmuls took 19.9 us with these kernels against 35.2 us for
# cuBLAS after the separate norm / SiLU kernels (o_proj alone: 3.9 against cuBLAS' 12.0, whose
# kernel for that shape runs too few programs).
MAX_ROWS = 1
# Several rows (a small decode batch, a code predictor's frame at batch 8) can take a
# tensor-core variant (rows padded to 16 and masked, tl.dot), the norm or SiLU still folded in
# front, up to FEW_ROWS rows on the GPUs listed in FEW_ROWS_FASTER: none. On an H200 it lost
# to cuBLAS after the separate norm / SiLU kernels at 2, 8 and 16 rows on every matmul of
# Qwen3-0.6B and 1.7B (qkv 9.9 against 6.9 us, down 35-84 against 9-13; AR decode of 8
# sequences 3.6 against 1.4 ms a step; benchmarks/results/runs/issue41_h200_s25/): cuBLAS'
# split-K kernels for a few rows stream well, unlike its one-row ones. The CUDA-core loop it
# replaced took 2-4x cuBLAS' time at four rows.
FEW_ROWS = 16
FEW_ROWS_FASTER: tuple[str, ...] = ()


def max_rows(x: Tensor) -> int:
    """The most rows of x these kernels take here by default."""
    name = gpu_name(x)
    return FEW_ROWS if name and any(g in name for g in FEW_ROWS_FASTER) else MAX_ROWS


def config(n: int, k: int, rows: int) -> dict[str, int]:
    """Tile sizes: one row's (below), or several rows' (`few_rows_config`)."""
    return one_row_config(n, k) if rows == 1 else few_rows_config(n, k)


def few_rows_config(n: int, k: int) -> dict[str, int]:
    """Several rows (tensor cores): 16 outputs a program over 256-wide K tiles, or 32 for wide
    layers (more programs than SMs either way); swept by kernels/sweep_gemv.py."""
    return dict(BLOCK_N=16 if n <= 8192 else 32, BLOCK_K=256, num_warps=4, num_stages=1)


def one_row_config(n: int, k: int) -> dict[str, int]:
    """Tile sizes, swept inside a whole one-row step with PDL's early launch (pdl.py) on an
    H100 over Qwen3-0.6B's four decode matmuls (BLOCK_N 4-32, BLOCK_K 1024 or K's next power
    of two, 4 or 8 warps): a program takes its whole weight slab (K up to 4096) in one tile,
    fetched before its wait. 16 outputs x 1024 in 4 warps (qkv, gate_up); 8 x the next power
    of two of K in 8 warps (o 2048, down 4096 with 3072 used). The H100's 28 layers took 675
    us against 710 with the first sweep's choice and 815 with the tiles before and no early
    launch (benchmarks/results/layers_pdl_early_h100.json, runs/pdl_early_h100/). An H200
    takes them too: its single stream made 1397 tok/s with them against 1016 with the tiles
    swept for it alone before (runs/pdl_early_h200/). Other GPUs take them too."""
    if n >= 32768 and k <= 4096:   # a vocabulary's lm_head (lm_head_faster_here)
        return dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=1)
    if k <= 1024:
        return dict(BLOCK_N=16, BLOCK_K=1024, num_warps=4, num_stages=1)
    if k <= 4096:
        return dict(BLOCK_N=8, BLOCK_K=triton.next_power_of_2(k), num_warps=8, num_stages=1)
    return dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=3)


@triton.jit
def _prologue(x_rows, r_rows, NW, k, mask, inv, K, dt: tl.constexpr, NORM: tl.constexpr,
              ADD: tl.constexpr, SILU: tl.constexpr):
    """The activations at columns k (ROWS, len(k)) in x's dtype, the op in front applied:
    silu(gate) * up, or x [+ residual] [-> RMSNorm with the rows' inverse RMS `inv`]."""
    if SILU:
        gate = tl.load(x_rows + k[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_rows + K + k[None, :], mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        x = (act * up).to(dt)
    else:
        x = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
        if ADD:
            x = (x.to(tl.float32) + tl.load(r_rows + k[None, :], mask=mask, other=0.0
                                            ).to(tl.float32)).to(dt)
    if NORM:
        nw = tl.load(NW + k, mask=k < K, other=0.0).to(tl.float32)
        x = ((x.to(tl.float32) * inv[:, None]).to(dt).to(tl.float32) * nw[None, :]).to(dt)
    return x


@triton.jit
def _byte_plane(w, j: tl.constexpr):
    """Byte j of each int32 word of w (four int8 weights, little-endian) as float32, exactly:
    sign-extended by two shifts, then 2^23 + 2^22 + v's bits read as a float, less that float
    (the int-to-float instruction runs at a quarter of the ALUs' rate)."""
    v = (w << (24 - 8 * j)) >> 24                          # arithmetic: sign-extended
    return (v + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _gemv_kernel(X, R, NW, W, B, S, Out, Sum, M, N, K, eps,
                 stride_xm, stride_rm, stride_wn, stride_om, stride_sm, stride_s,
                 ROWS: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr, SILU: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr, DOT: tl.constexpr,
                 IEEE: tl.constexpr, PACKED: tl.constexpr, PDL: tl.constexpr):
    if PDL == 2:
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    dt = X.dtype.element_ty
    r = tl.arange(0, ROWS)
    r_ok = r < M
    x_rows = X + r[:, None].to(tl.int64) * stride_xm                      # (ROWS, 1)
    r_rows = R + r[:, None].to(tl.int64) * stride_rm
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    WORD: tl.constexpr = 4 if PACKED else 1                      # weights a loaded element
    WK: tl.constexpr = BLOCK_K // WORD                            # elements a tile's row
    w_ptrs = W + n[:, None].to(tl.int64) * stride_wn + tl.arange(0, WK)[None, :]
    # the first weight tile (weights: never written by a kernel) is fetched before waiting on
    # the previous kernel (pdl.py); each iteration below fetches the next one
    w = tl.load(w_ptrs, mask=n_ok[:, None] & (WORD * tl.arange(0, WK) < K)[None, :], other=0.0)
    if PDL:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()
    if NORM:   # pass 1: each row's inverse RMS (and, with a residual, its sum, by program 0)
        ss = tl.zeros([ROWS, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            mask = r_ok[:, None] & (k < K)[None, :]
            x = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
            if ADD:
                x = (x.to(tl.float32) + tl.load(r_rows + k[None, :], mask=mask, other=0.0
                                                ).to(tl.float32)).to(dt)
                if pid_n == 0:
                    tl.store(Sum + r[:, None].to(tl.int64) * stride_sm + k[None, :], x,
                             mask=mask)
            xf = x.to(tl.float32)
            ss += xf * xf
        inv = tl.rsqrt(tl.sum(ss, 1) / K + eps)                           # (ROWS,)
    else:
        inv = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if ONE_TILE:   # K <= BLOCK_K: the whole slab came before the wait
            w_next = w
        else:
            w_ptrs += WK                                                    # the next tile
            w_next = tl.load(w_ptrs, mask=n_ok[:, None]
                             & (k0 + BLOCK_K + WORD * tl.arange(0, WK) < K)[None, :], other=0.0)
        k = k0 + tl.arange(0, BLOCK_K)
        x = _prologue(x_rows, r_rows, NW, k, r_ok[:, None] & (k < K)[None, :], inv, K, dt,
                      NORM, ADD, SILU)
        if PACKED:     # one row, four 8-bit weights a word: x split into the words' byte planes
            xe, xo = tl.split(tl.reshape(x.to(tl.float32), (WK, 2, 2)))   # x[4i + 2b (+ 1)]
            x0, x2 = tl.split(xe)
            x1, x3 = tl.split(xo)
            prods = (_byte_plane(w, 0) * x0[None, :] + _byte_plane(w, 1)
                     * x1[None, :] + _byte_plane(w, 2) * x2[None, :]
                     + _byte_plane(w, 3) * x3[None, :])
            acc += tl.sum(prods, 1)[None, :]
        else:
            if DOT:    # several rows: the tensor cores (rows padded to 16, masked to 0)
                wd = tl.trans(w.to(dt))                                   # (BLOCK_K, BLOCK_N)
                if IEEE:
                    acc = tl.dot(x, wd, acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, wd, acc)
            else:      # one row: products summed on the CUDA cores
                acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), 1)[None, :]
        w = w_next
    if SCALED:     # an 8-bit weight's scale per output channel (stride_s 0: per tensor)
        acc *= tl.load(S + n * stride_s, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + r[:, None].to(tl.int64) * stride_om + n[None, :],
             acc.to(Out.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


def lm_head_faster_here(x: Tensor) -> bool:
    """Whether a one-row lm_head (a vocabulary of rows) runs faster here than cuBLAS, as
    measured (benchmarks/results/lm_head_qwen3-0.6b.json, 151936 x 1024 bf16): an H100, 106 us
    against cuBLAS' 132; not an H200 (82 against 77) nor GPUs nobody measured."""
    return "H100" in gpu_name(x)


# weights read with a scale per output channel (W8A16): FP8 (layers/fp8.py) and INT8
# (layers/int8.py), both (N, K) row-major; fused.py hands these their linear's scale
SCALED_WEIGHTS = (torch.float8_e4m3fn, torch.int8)


def applies(x: Tensor, weight: Tensor, rows: int | None = None) -> bool:
    """Whether these kernels take a matmul of x (rows, K): few rows (up to `rows`, default
    `max_rows(x)`), the weight in x's dtype or 8-bit (with its scale), dense rows."""
    return (x.dim() == 2 and 0 < x.shape[0] <= (max_rows(x) if rows is None else rows)
            and (x.dtype == weight.dtype or weight.dtype in SCALED_WEIGHTS)
            and x.stride(-1) == 1 and weight.dim() == 2 and weight.is_contiguous())


def packing(weight: Tensor, rows: int) -> bool:
    """Whether the kernel reads an INT8 weight at one row as int32 words, four weights each,
    widened by shifts (`_byte_plane`), rather than a weight a lane through the int-to-float
    instruction. On an H200 (Qwen3-1.7B's four matmuls, best tiles each; session 28,
    benchmarks/results/runs/issue44_h200_s28/) the words took 5.8 / 3.0 / 12.6 / 7.7 us
    against 7.1 / 3.4 / 17.5 / 8.4 a lane. FP8 stays a lane: the same trick for e4m3 (its
    bits moved into a float32's, times 2^120) ran slower than the conversion instructions."""
    return (rows == 1 and weight.dtype == torch.int8 and weight.shape[1] % 4 == 0
            and weight.is_contiguous() and weight.data_ptr() % 4 == 0)


def _launch(x: Tensor, residual: Tensor | None, norm_weight: Tensor | None, eps: float,
            weight: Tensor, bias: Tensor | None, silu: bool, in_features: int,
            cfg: dict[str, int] | None = None, scale: Tensor | None = None
            ) -> tuple[Tensor, Tensor | None]:
    rows, n = x.shape[0], weight.shape[0]
    assert weight.shape[1] == in_features, (weight.shape, in_features)
    assert (scale is not None) == (weight.dtype in SCALED_WEIGHTS), \
        f"a {weight.dtype} weight {'needs' if scale is None else 'takes no'} scale"
    if scale is not None:         # (N,), (N, 1), (1, N): one a channel; one element: a tensor's
        scale = scale.reshape(-1)
        assert scale.numel() in (1, n), f"{scale.numel()} scales for {n} outputs"
    cfg = dict(cfg or config(n, in_features, rows))
    cfg.setdefault("PACKED", packing(weight, rows))
    if cfg["PACKED"]:
        weight = weight.view(torch.int32)                 # (N, K / 4): four weights a word
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    total = torch.empty(rows, in_features, dtype=x.dtype, device=x.device) \
        if residual is not None else None
    r = residual if residual is not None else x
    s = total if total is not None else out
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, r, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else x, scale if scale is not None else x, out, s, rows, n,
        in_features, eps, x.stride(0), r.stride(0), weight.stride(0), out.stride(0),
        s.stride(0), 0 if scale is None or scale.numel() == 1 else 1,
        ROWS=1 if rows == 1 else max(16, triton.next_power_of_2(rows)),
        NORM=norm_weight is not None, ADD=residual is not None, SILU=silu,
        HAS_BIAS=bias is not None, SCALED=scale is not None,
        ONE_TILE=in_features <= cfg["BLOCK_K"], DOT=rows > 1, IEEE=x.dtype == torch.float32,
        **cfg,
        **pdl.launch_options(x, "gemv"))
    return out, total


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           scale: Tensor | None = None) -> Tensor:
    """x W^T + b for x (rows, K), weight (N, K) (an FP8 one with its `scale`)."""
    out, _ = _launch(x, None, None, 0.0, weight, bias, False, x.shape[1], scale=scale)
    return out


def norm_linear(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
    """s = x + residual (x alone without one); returns (rms_norm(s) W^T + b, s).
    x, residual: (rows, K); weight (N, K)."""
    out, total = _launch(x, residual, norm_weight, eps, weight, bias, False, x.shape[1],
                         scale=scale)
    return out, (total if total is not None else x)


def silu_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                scale: Tensor | None = None) -> Tensor:
    """x (rows, 2I) laid out | gate | up | -> (silu(gate) * up) W^T + b, (rows, N)."""
    out, _ = _launch(x, None, None, 0.0, weight, bias, True, x.shape[1] // 2, scale=scale)
    return out
