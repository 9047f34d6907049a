"""The 4-bit matrix-vector product of 1 to 4 rows (W4A16, layers/int4.py) split along K across
programs (issue 44): the second kernel of triton_int4.py, chosen there by `set_kernel` /
`SPLIT_FASTER` (CUDA; Triton's interpreter on CPU).

A decode step's int4 matmul reads a quarter of bf16's weight bytes, so it is bound by how many
bytes are in flight (programs x tile) and by the instructions a weight, not by the bytes. The
grid is (N / BLOCK_N, SPLIT_K): program (i, s) takes BLOCK_N outputs and the s-th run of K
tiles, each tile GROUPS whole groups of G inputs (G / 8 words):

    words   (BLOCK_N, GROUPS, G / 8) int32    lo = word | M, hi = (word >> 16) | M,
                                              M = 0x4B000000 (the bits of 2^23)
    nibble i of a word, u in [0, 15] stored for q = u - 8, with no shift (i < 4: lo, else hi),
    j = i % 4:  bits((lo or hi) & (M | 0xF << 4j)) = 2^23 + u 16^j  (a float, exactly), so
        q = that * 16^-j - (2^(23 - 4j) + 8)    (one fused multiply-add, exact)
    x_i     (GROUPS, G / 8) a row             x[8 word + i]   (shared by all N)
    d[n, w]    = sum over the word's 8 inputs of q * x_i      (float32; q exact)
    a_r[n, w] += d * scale[n, group(w)]       (the scale once a word: 8 weights, no sum
                                               across threads until the last tile)
    out[r, n]  = sum over w of a_r[n, w]

so a weight costs one logic op and one fused multiply-add (the integer-to-float conversion,
a quarter-rate instruction, replaced by the float's bits), and one more a row; a
wide BLOCK_N lets each thread reuse the activations it holds for several outputs. Numerics:
the exact weight q * s (as dequantize_int4 in float32) times x, summed in float32 in another
order; the per-call path and triton_int4's first kernel round each weight to the scales' dtype
first. Compiled for sm_90 (Triton 3.6, ptxas) the one-row loop runs about 5 instructions a
weight at BLOCK_N 64-128 (about 9-12 at 8-16) and 10 at four rows.

With SPLIT_K > 1 each program writes its float32 partial sums to a (SPLIT_K, rows, N) buffer
and a second small kernel adds them in split order, adds the bias and casts: deterministic (no
atomics; the same output on every run), one more launch, which PDL overlaps (pdl.py, kind
"gemv"). With SPLIT_K 1 the first kernel stores the output itself. Tiles per (N, K) come from
`TILES` (swept on a GPU by benchmarks/kernels/int4_sweep.py, which writes that table), else
from `default_config`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from omnistage.layers import pdl

MAX_ROWS = 4
# (N, K, rows padded to 1, 2 or 4) -> tiles, from benchmarks/kernels/int4_sweep.py's "tiles":
# int4_split_tiles.json, swept on an H200 (Qwen3-0.6B / 1.7B / 8B's matmuls at 1, 2, 4 rows),
# loaded below; other GPUs start from the same table
TILES: dict[tuple[int, int, int], dict[str, int]] = {}
SWEPT = Path(__file__).with_name("int4_split_tiles.json")
TARGET_PROGRAMS = 264     # two a multiprocessor of an H200 (132)


def default_config(n: int, k: int, group: int, rows: int = 1) -> dict[str, int]:
    """Unswept shapes: 64 outputs a program at one row, 32 at more (fewer for narrow layers;
    more spill registers on sm_90) over tiles of 256 inputs (or one group when larger), and
    splits of K (at most 16, each at least one tile) until the grid holds about
    TARGET_PROGRAMS programs. A guess from the compiled code, not measured."""
    block_k = max(group, 256)
    block_n = max(16, min(64 if rows == 1 else 32, triton.next_power_of_2(n)))
    tiles = -(-k // block_k)
    split = max(1, min(16, tiles, -(-TARGET_PROGRAMS // -(-n // block_n))))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=1)


def config(n: int, k: int, group: int, rows: int = 1) -> dict[str, int]:
    return dict(TILES.get((n, k, triton.next_power_of_2(rows)))
                or default_config(n, k, group, rows))


TILE_KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")


def load_tiles(sweep: dict) -> int:
    """Put the "tiles" of int4_sweep.py's JSON ([{"n", "k", "rows", BLOCK_N, BLOCK_K,
    SPLIT_K, num_warps, num_stages}, ...]) into TILES; returns how many."""
    for entry in sweep["tiles"]:
        missing = [key for key in ("n", "k", "rows", *TILE_KEYS) if key not in entry]
        if missing:
            raise ValueError(f"int4 tiles entry {entry}: missing {missing}")
        key = (int(entry["n"]), int(entry["k"]), triton.next_power_of_2(int(entry["rows"])))
        TILES[key] = {name: int(entry[name]) for name in TILE_KEYS}
    return len(sweep["tiles"])


load_tiles(json.loads(SWEPT.read_text()))


def applies(group_size: int) -> bool:
    """Groups of a power-of-two number of whole words (32, 64, 128, ...: tl.arange sizes)."""
    words = group_size // 8
    return group_size % 8 == 0 and words > 0 and words & (words - 1) == 0


@triton.jit(do_not_specialize=["M", "NUM_GROUPS", "TILES_PER_SPLIT"])
def _split_kernel(X, P, S, B, Out, Part, M, N, K, KW, NUM_GROUPS, TILES_PER_SPLIT,
                  stride_xm, stride_pn, stride_sn, stride_om, stride_qs, stride_qm,
                  GROUP_W: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                  PDL: tl.constexpr):
    if PDL == 2:
        gdc_launch_dependents()
    pid_n, split = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    r = tl.arange(0, ROWS)
    g = tl.arange(0, GROUPS)
    gw = g[:, None] * GROUP_W + tl.arange(0, GROUP_W)[None, :]           # (GROUPS, GROUP_W)
    num_tiles = tl.cdiv(KW, GROUPS * GROUP_W)
    t0 = split * TILES_PER_SPLIT
    t1 = tl.minimum(t0 + TILES_PER_SPLIT, num_tiles)
    p_rows = P + n[:, None, None].to(tl.int64) * stride_pn               # (BLOCK_N, 1, 1)
    s_rows = S + n[:, None].to(tl.int64) * stride_sn                      # (BLOCK_N, 1)
    # the first tile (weights: never written by a kernel) before waiting on the previous one
    word = t0 * GROUPS * GROUP_W + gw
    w_ok = n_ok[:, None, None] & ((word < KW) & (t0 < t1))[None, :, :]
    words = tl.load(p_rows + word[None, :, :], mask=w_ok, other=0)
    grp = t0 * GROUPS + g
    scales = tl.load(s_rows + grp[None, :], mask=n_ok[:, None] & ((grp < NUM_GROUPS)
                                                                  & (t0 < t1))[None, :],
                     other=0.0)
    if PDL:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()
    a0 = tl.zeros([BLOCK_N, GROUPS, GROUP_W], tl.float32)   # row r's sums a word: a_r
    a1 = tl.zeros([BLOCK_N, GROUPS, GROUP_W], tl.float32)
    a2 = tl.zeros([BLOCK_N, GROUPS, GROUP_W], tl.float32)
    a3 = tl.zeros([BLOCK_N, GROUPS, GROUP_W], tl.float32)
    for t in range(t0, t1):
        nxt = word + GROUPS * GROUP_W
        words_next = tl.load(p_rows + nxt[None, :, :], mask=n_ok[:, None, None] & (
            (nxt < KW) & (t + 1 < t1))[None, :, :], other=0)
        grp_next = grp + GROUPS
        scales_next = tl.load(s_rows + grp_next[None, :], mask=n_ok[:, None] & (
            (grp_next < NUM_GROUPS) & (t + 1 < t1))[None, :], other=0.0)
        a0, a1, a2, a3 = _tile_dot(words, scales.to(tl.float32)[:, :, None], X, stride_xm,
                                   word, M, K, a0, a1, a2, a3, ROWS)
        words, scales, word, grp = words_next, scales_next, nxt, grp_next
    acc = tl.where(r[:, None] == 0, tl.sum(tl.sum(a0, 2), 1)[None, :], 0.0)  # (ROWS, BN)
    if ROWS > 1:
        acc += tl.where(r[:, None] == 1, tl.sum(tl.sum(a1, 2), 1)[None, :], 0.0)
    if ROWS > 2:
        acc += tl.where(r[:, None] == 2, tl.sum(tl.sum(a2, 2), 1)[None, :], 0.0)
        acc += tl.where(r[:, None] == 3, tl.sum(tl.sum(a3, 2), 1)[None, :], 0.0)
    if not PARTIAL:
        if HAS_BIAS:
            acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + r[:, None].to(tl.int64) * stride_om + n[None, :],
                 acc.to(Out.dtype.element_ty), mask=(r < M)[:, None] & n_ok[None, :])
    else:
        tl.store(Part + split * stride_qs + r[:, None] * stride_qm + n[None, :], acc,
                 mask=(r < M)[:, None] & n_ok[None, :])


@triton.jit
def _tile_dot(words, scales, X, stride_xm, word, M, K, a0, a1, a2, a3, ROWS: tl.constexpr):
    """a_r += (sum over a word's 8 inputs of q * x_r) * the word's group scale, for one tile
    (module docstring). The weight side stays in the words' layout (BLOCK_N, GROUPS, GROUP_W):
    no sum across threads until the last tile."""
    lo = words | 0x4B000000                  # (a | m) & (b | m) = (a & b) | m: one op a nibble
    hi = (words >> 16) | 0x4B000000          # nibbles 4..7 at bits 0..15
    kk = word[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]           # (GROUPS, GW, 8)
    k_ok = kk < K
    x0 = _row_x(X + kk, k_ok)
    if ROWS > 1:
        x1 = _row_x(X + stride_xm + kk, k_ok & (1 < M))
    if ROWS > 2:
        x2 = _row_x(X + 2 * stride_xm + kk, k_ok & (2 < M))
        x3 = _row_x(X + 3 * stride_xm + kk, k_ok & (3 < M))
    for i in tl.static_range(8):
        if i < 4:
            half = lo
        else:
            half = hi
        # bits 2^23 + u 16^j (j = i % 4), times 16^-j (exact) minus 2^(23 - 4j) + 8: exactly
        # q = u - 8, in one fused multiply-add
        q = (half & (0x4B000000 | (0xF << (4 * (i % 4))))).to(tl.float32, bitcast=True)
        q = q * (1.0 / (1 << (4 * (i % 4)))) - (8388608.0 / (1 << (4 * (i % 4))) + 8.0)
        if i == 0:
            d0 = q * x0[i][None, :, :]
            if ROWS > 1:
                d1 = q * x1[i][None, :, :]
            if ROWS > 2:
                d2 = q * x2[i][None, :, :]
                d3 = q * x3[i][None, :, :]
        else:
            d0 += q * x0[i][None, :, :]
            if ROWS > 1:
                d1 += q * x1[i][None, :, :]
            if ROWS > 2:
                d2 += q * x2[i][None, :, :]
                d3 += q * x3[i][None, :, :]
    a0 += d0 * scales
    if ROWS > 1:
        a1 += d1 * scales
    if ROWS > 2:
        a2 += d2 * scales
        a3 += d3 * scales
    return a0, a1, a2, a3


@triton.jit
def _row_x(ptrs, mask):
    """One row's tile of activations (GROUPS, GROUP_W, 8), read contiguously, as its 8 slices
    x[8 word + i] (GROUPS, GROUP_W), i = 0..7."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x = tl.reshape(x, (x.shape[0], x.shape[1], 2, 2, 2))   # 8 word + 4 a + 2 b + c
    c0, c1 = tl.split(x)
    b0c0, b1c0 = tl.split(c0)
    b0c1, b1c1 = tl.split(c1)
    s0, s4 = tl.split(b0c0)
    s2, s6 = tl.split(b1c0)
    s1, s5 = tl.split(b0c1)
    s3, s7 = tl.split(b1c1)
    return s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def _reduce_kernel(Part, B, Out, N, stride_qs, stride_qm, stride_om, SPLIT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Out[row] = sum of the SPLIT partials in split order (+ bias), in Out's dtype."""
    if PDL == 2:
        gdc_launch_dependents()
    row = tl.program_id(1)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n_ok = n < N
    acc = tl.zeros([BLOCK], tl.float32)
    if HAS_BIAS:
        acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()
    total = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        total += tl.load(Part + s * stride_qs + row * stride_qm + n, mask=n_ok, other=0.0)
    tl.store(Out + row.to(tl.int64) * stride_om + n, (total + acc).to(Out.dtype.element_ty),
             mask=n_ok)


REDUCE_BLOCK = 1024


def linear(x: Tensor, packed: Tensor, scale: Tensor, group_size: int,
           bias: Tensor | None = None, cfg: dict[str, int] | None = None) -> Tensor:
    """x W^T (+ b) for x (rows, K), 1 to MAX_ROWS rows, and W the (N, K) weight of `packed`
    (N, ceil(K / 8)) int32 words and `scale` (N, ceil(K / G)); out (rows, N) in x's dtype.
    `cfg`: tiles (BLOCK_N, BLOCK_K inputs, SPLIT_K, num_warps, num_stages), else `config`."""
    rows, k = x.shape
    n, kw = packed.shape
    num_groups = -(-k // group_size)
    assert 0 < rows <= MAX_ROWS and x.stride(-1) == 1, (tuple(x.shape), x.stride())
    assert kw == -(-k // 8) and scale.shape == (n, num_groups), \
        (tuple(packed.shape), tuple(scale.shape), k, group_size)
    assert applies(group_size) and packed.is_contiguous(), group_size
    cfg = dict(cfg or config(n, k, group_size, rows))
    block_k, split = cfg.pop("BLOCK_K"), cfg.pop("SPLIT_K")
    groups = max(1, block_k // group_size)
    assert groups & (groups - 1) == 0, f"BLOCK_K {block_k}: not 2^i groups of {group_size}"
    num_tiles = -(-kw // (groups * group_size // 8))
    per_split = -(-num_tiles // max(1, min(split, num_tiles)))
    split = -(-num_tiles // per_split)               # no split without a tile
    scale = scale.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, rows, n, dtype=torch.float32, device=x.device) \
        if split > 1 else out
    opts = pdl.launch_options(x, "gemv")
    b = bias if bias is not None else x
    _split_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
        x, packed, scale, b, out, part, rows, n, k, kw, num_groups, per_split, x.stride(0),
        packed.stride(0), scale.stride(0), out.stride(0), part.stride(0), part.stride(1),
        GROUP_W=group_size // 8, GROUPS=groups, ROWS=triton.next_power_of_2(rows),
        PARTIAL=split > 1, HAS_BIAS=bias is not None, **cfg, **opts)
    if split > 1:
        _reduce_kernel[(triton.cdiv(n, REDUCE_BLOCK), rows)](
            part, b, out, n, part.stride(0), part.stride(1), out.stride(0), SPLIT=split,
            HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK, num_warps=4, **opts)
    return out
