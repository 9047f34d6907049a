"""Fused Triton kernels for the small ops of a decoder layer (CUDA; Triton's interpreter on CPU).

Each replaces a chain of PyTorch kernels that would each read and write the activations:

    rms_norm         x -> float32 -> normalise -> back to x's dtype -> * weight       (4 -> 1)
    add_rms_norm     the residual add in front of it, returning the sum as well       (5 -> 1)
    silu_and_mul     | gate | up | -> silu(gate) * up                                (2 -> 1)
    qk_norm_rope     per-head RMSNorm of q and k (Qwen3), then the rotate-half RoPE,
                     cos/sin rows gathered from the table by position inside the kernel (~25 -> 1);
                     M-RoPE too (each frequency's angle from its axis's position row)
    qk_norm_rope_store  the same, writing k and v straight into their paged-cache slots
                     (slot -1: nothing) instead of returning k: the attention's K/V store
                     kernel is saved (the attention then reads them from the cache)

and for a diffusion transformer's block (Wan, Qwen-Image, FLUX), each over the whole stream:

    norm_modulate    x -> float32 -> LayerNorm [affine] [* (1 + scale) + shift] -> x's dtype
                     (diffusers' FP32LayerNorm and adaLN modulation; 5 -> 1)
    gated_add        x + y * gate in float32 -> x's dtype (the gated residual; 3 -> 1)
    rope_pairs       interleaved pairs of every head rotated by cos/sin rows (~6 -> 1)
    rms_norm_rope_pairs  per-head RMSNorm of q or k, then rope_pairs (Qwen-Image, FLUX; ~8 -> 1)

Numerics follow the Hugging Face modules they replace: the normalised value is rounded to the
input dtype before the weight multiplies it, the residual sum is rounded to the input dtype, and
silu(gate) is rounded before the product. The rotary rotation is done in float32 with float32
cos/sin (HF rounds cos/sin to the input dtype first), so in bfloat16 it is slightly closer to
the exact value than the reference; in float32 it is the same arithmetic.

The DiT kernels keep diffusers' float32 arithmetic (statistics, products, the rotation) and
round once, to x's dtype, at the end: what the PyTorch chains compute, without their float32
copies of the stream in memory.

Callers go through omnistage/layers/fused.py, which decides when these can run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from omnistage.layers import pdl


@triton.jit
def _rms_norm_kernel(X, R, W, Out, Sum, stride_x, stride_r, stride_o, stride_s, N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=mask, other=0.0
                                         ).to(tl.float32)).to(X.dtype.element_ty)
        tl.store(Sum + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * inv).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (normed * w).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * up).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _norm_rope_heads(X, W, Dst, t, stride_t, stride_h, dst_stride_h, c1, c2, s1, s2, eps,
                     valid, H: tl.constexpr, HALF: tl.constexpr, H_P2: tl.constexpr,
                     HALF_P2: tl.constexpr, HAS_NORM: tl.constexpr):
    """Rows of one token's H heads: optional RMSNorm over each head, then rotate-half RoPE,
    stored at Dst (this token's row) + head * dst_stride_h, where `valid`."""
    h = tl.arange(0, H_P2)[:, None]
    j = tl.arange(0, HALF_P2)[None, :]
    mask = (h < H) & (j < HALF) & valid
    src = X + t * stride_t + h * stride_h + j
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)             # (H, D/2) first half
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)      # second half
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(W + j, mask=j < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(W + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
        dt = X.dtype.element_ty
        x1 = ((x1 * inv).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * inv).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    dst = Dst + h * dst_stride_h + j
    tl.store(dst, (x1 * c1 - x2 * s1).to(Dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * c2 + x1 * s2).to(Dst.dtype.element_ty), mask=mask)


# stride_pos is the step's token count for M-RoPE positions (3, T): specialising on it (T
# divisible by 16 or not) would build a second variant mid-serving for some batch sizes
@triton.jit(do_not_specialize=["stride_pos"])
def _qk_norm_rope_kernel(Q, K, V, QW, KW, Cos, Sin, Pos, Axis, QOut, KOut, VOut, Slots,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cos, stride_pos, stride_cs, stride_ch, eps,
                         HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
                         HQ_P2: tl.constexpr, HK_P2: tl.constexpr, HALF_P2: tl.constexpr,
                         HAS_NORM: tl.constexpr, STORE: tl.constexpr, MROPE: tl.constexpr,
                         PDL: tl.constexpr):
    """STORE: KOut / VOut are the paged caches, row slot_mapping[t] (stride_cs, stride_ch per
    head); else KOut is a contiguous (T, HK, D) output and V is untouched. MROPE: the tables
    hold D/2 frequencies, and frequency j takes its angle from position row Axis[j] of Pos
    (rows stride_pos apart; 0 for 1-D positions: every row is the same)."""
    if PDL == 2:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HALF_P2)[None, :]
    jm = j < HALF
    if MROPE:
        axis = tl.load(Axis + j, mask=jm, other=0).to(tl.int64)
        row = tl.load(Pos + axis * stride_pos + t, mask=jm, other=0).to(tl.int64) * stride_cos
        c1 = tl.load(Cos + row + j, mask=jm, other=0.0)
        s1 = tl.load(Sin + row + j, mask=jm, other=0.0)
        c2 = c1
        s2 = s1
    else:
        row = tl.load(Pos + t).to(tl.int64) * stride_cos
        c1 = tl.load(Cos + row + j, mask=jm, other=0.0)
        c2 = tl.load(Cos + row + HALF + j, mask=jm, other=0.0)
        s1 = tl.load(Sin + row + j, mask=jm, other=0.0)
        s2 = tl.load(Sin + row + HALF + j, mask=jm, other=0.0)
    _norm_rope_heads(Q, QW, QOut + t * (HQ * 2 * HALF), t, stride_qt, stride_qh, 2 * HALF,
                     c1, c2, s1, s2, eps, t >= 0, HQ, HALF, HQ_P2, HALF_P2, HAS_NORM)
    if STORE:
        slot = tl.load(Slots + t)
        k_dst = KOut + slot * stride_cs
        _norm_rope_heads(K, KW, k_dst, t, stride_kt, stride_kh, stride_ch, c1, c2, s1, s2,
                         eps, slot >= 0, HK, HALF, HK_P2, HALF_P2, HAS_NORM)
        h = tl.arange(0, HK_P2)[:, None]
        d = tl.arange(0, 2 * HALF_P2)[None, :]
        v_mask = (h < HK) & (d < 2 * HALF) & (slot >= 0)
        v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=v_mask)
        tl.store(VOut + slot * stride_cs + h * stride_ch + d, v, mask=v_mask)
    else:
        _norm_rope_heads(K, KW, KOut + t * (HK * 2 * HALF), t, stride_kt, stride_kh, 2 * HALF,
                         c1, c2, s1, s2, eps, t >= 0, HK, HALF, HK_P2, HALF_P2, HAS_NORM)


@triton.jit
def _norm_modulate_kernel(X, W, B, Scale, Shift, Out, stride_x, stride_o, rows_per_mod, N, eps,
                          AFFINE: tl.constexpr, MODULATE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    d = tl.where(mask, x - mean, 0.0)
    y = d * tl.rsqrt(tl.sum(d * d, axis=0) / N + eps)
    if AFFINE:
        y = y * tl.load(W + cols, mask=mask, other=1.0) + tl.load(B + cols, mask=mask, other=0.0)
    if MODULATE:
        m = (row // rows_per_mod) * N + cols
        scale = tl.load(Scale + m, mask=mask, other=0.0)
        y = y * (1.0 + scale) + tl.load(Shift + m, mask=mask, other=0.0)
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _gated_add_kernel(X, Y, G, Out, stride_x, stride_y, stride_o, rows_per_gate, N,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + (row // rows_per_gate) * N + cols, mask=mask, other=0.0)
    tl.store(Out + row * stride_o + cols, (x + y * g).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rope_pairs_kernel(X, Cos, Sin, Out, stride_x, stride_o, stride_ct, stride_cj, tokens,
                       half, P, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                 # one token, all its heads
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # pair index over heads x half
    mask = i < P
    t = (row % tokens) * stride_ct + (i % half) * stride_cj
    c = tl.load(Cos + t, mask=mask, other=0.0)
    s = tl.load(Sin + t, mask=mask, other=0.0)
    even = tl.load(X + row * stride_x + 2 * i, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(X + row * stride_x + 2 * i + 1, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + 2 * i, (even * c - odd * s).to(Out.dtype.element_ty),
             mask=mask)
    tl.store(Out + row * stride_o + 2 * i + 1, (even * s + odd * c).to(Out.dtype.element_ty),
             mask=mask)


@triton.jit
def _rms_norm_rope_pairs_kernel(X, W, Cos, Sin, Out, stride_x, stride_o, stride_ct, stride_cj,
                                tokens, eps, H: tl.constexpr, HALF: tl.constexpr,
                                H_P2: tl.constexpr, HALF_P2: tl.constexpr):
    # one token, all its heads, read and written as contiguous (H, 2 * HALF) rows (the pairs
    # split apart in registers: strided loads of every other element ran ~10x slower)
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_P2)[:, None]
    d = tl.arange(0, 2 * HALF_P2)[None, :]
    mask = (h < H) & (d < 2 * HALF)
    x = tl.load(X + row * stride_x + h * (2 * HALF) + d, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + d, mask=d < 2 * HALF, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 1) / (2 * HALF) + eps)[:, None]
    even, odd = tl.split(tl.reshape(x * inv * w, (H_P2, HALF_P2, 2)))   # (H, hd/2) each
    j = tl.arange(0, HALF_P2)[None, :]
    t = (row % tokens) * stride_ct + j * stride_cj
    c = tl.load(Cos + t, mask=j < HALF, other=0.0)
    s = tl.load(Sin + t, mask=j < HALF, other=0.0)
    y = tl.reshape(tl.join(even * c - odd * s, even * s + odd * c), (H_P2, 2 * HALF_P2))
    tl.store(Out + row * stride_o + h * (2 * HALF) + d, y.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows_fp8_kernel(X, Q, S, stride_x, stride_q, N, fp8_max, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / fp8_max
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)  # IEEE /, as torch
    tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row, scale)


def _rows(x: Tensor) -> Tensor:
    """x as (rows, last) with a row stride (a copy only if the rows are not evenly strided)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim of x (..., N) -> (..., N) in x's dtype (HF numerics)."""
    xr = _rows(x)
    out = torch.empty(xr.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    if xr.shape[0]:
        _rms_norm_kernel[(xr.shape[0],)](
            xr, xr, weight, out, out, xr.stride(0), 0, out.stride(0), 0, xr.shape[1], eps,
            HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(xr.shape[1]))
    return out.view(x.shape)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float
                 ) -> tuple[Tensor, Tensor]:
    """s = x + residual (rounded to x's dtype); returns (rms_norm(s), s). x, residual: (T, N)."""
    assert x.shape == residual.shape and x.dim() == 2, (x.shape, residual.shape)
    xr, rr = _rows(x), _rows(residual)
    out = torch.empty(xr.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    total = torch.empty(xr.shape, dtype=x.dtype, device=x.device)
    if xr.shape[0]:
        _rms_norm_kernel[(xr.shape[0],)](
            xr, rr, weight, out, total, xr.stride(0), rr.stride(0), out.stride(0),
            total.stride(0), xr.shape[1], eps, HAS_RESIDUAL=True,
            BLOCK=triton.next_power_of_2(xr.shape[1]))
    return out, total


def _per_row(mod: Tensor, x: Tensor) -> tuple[Tensor, int]:
    """A modulation (B, S, D), S = 1 or x's tokens, for x (B, N, D): as (B * S, D) rows, and
    how many of x's rows share one."""
    assert mod.dim() == 3 and mod.shape[0] == x.shape[0] and mod.shape[1] in (1, x.shape[1]) \
        and mod.shape[2] == x.shape[2], (tuple(mod.shape), tuple(x.shape))
    return mod.float().contiguous(), (x.shape[1] if mod.shape[1] == 1 else 1)


def norm_modulate(x: Tensor, eps: float, weight: Tensor | None = None,
                  bias: Tensor | None = None, scale: Tensor | None = None,
                  shift: Tensor | None = None) -> Tensor:
    """x (B, N, D) -> LayerNorm(x) [* weight + bias] [* (1 + scale) + shift] in x's dtype, all
    in float32 as diffusers' FP32LayerNorm and modulation; scale, shift (B, 1 or N, D)."""
    xr = _rows(x)
    out = torch.empty(xr.shape, dtype=x.dtype, device=x.device)
    affine, modulate = weight is not None, scale is not None
    scale, rows_per_mod = _per_row(scale, x) if modulate else (xr, 1)
    shift = _per_row(shift, x)[0] if modulate else xr
    block = triton.next_power_of_2(xr.shape[1])
    if xr.shape[0]:
        _norm_modulate_kernel[(xr.shape[0],)](
            xr, weight.float() if affine else xr, bias.float() if affine else xr, scale, shift,
            out, xr.stride(0), out.stride(0), rows_per_mod, xr.shape[1], eps, AFFINE=affine,
            MODULATE=modulate, BLOCK=block, num_warps=min(16, max(4, block // 512)))
    return out.view(x.shape)


def gated_add(x: Tensor, y: Tensor, gate: Tensor) -> Tensor:
    """x + y * gate (x, y (B, N, D), gate (B, 1 or N, D)) in float32, rounded to x's dtype."""
    xr, yr = _rows(x), _rows(y)
    gate, rows_per_gate = _per_row(gate, x)
    out = torch.empty(xr.shape, dtype=x.dtype, device=x.device)
    if xr.shape[0]:
        block = min(1024, triton.next_power_of_2(xr.shape[1]))
        _gated_add_kernel[(xr.shape[0], triton.cdiv(xr.shape[1], block))](
            xr, yr, gate, out, xr.stride(0), yr.stride(0), out.stride(0), rows_per_gate,
            xr.shape[1], BLOCK=block)
    return out.view(x.shape)


def quantize_rows_fp8(x: Tensor, fp8: torch.dtype, fp8_max: float) -> tuple[Tensor, Tensor]:
    """x (M, K) -> (q (M, K) in `fp8`, scale (M, 1) float32), each row's largest magnitude
    mapped to `fp8_max`: layers/fp8.py's quantize_rows in one pass over x (one read, one
    write) instead of the six kernels of its PyTorch form."""
    xr = _rows(x)
    q = torch.empty(xr.shape, dtype=fp8, device=x.device)
    scale = torch.empty((xr.shape[0], 1), dtype=torch.float32, device=x.device)
    if xr.shape[0]:
        block = triton.next_power_of_2(xr.shape[1])
        _quantize_rows_fp8_kernel[(xr.shape[0],)](
            xr, q, scale, xr.stride(0), q.stride(0), xr.shape[1], fp8_max, BLOCK=block,
            num_warps=min(16, max(4, block // 512)))
    return q, scale


def rope_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, N, H, hd): each head's interleaved pairs (x0, x1), ... rotated by the angles of
    cos, sin (N, hd/2) float32: (x0 cos - x1 sin, x0 sin + x1 cos), in x's dtype. The tables
    may be strided views alike (a complex table's .real / .imag, every other column of a
    table whose values repeat in pairs): read in place, no copy."""
    b, n, h, hd = x.shape
    xr = _rows(x.reshape(b, n, h * hd))
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride() == sin.stride(), \
        (cos.dtype, sin.dtype, cos.stride(), sin.stride())
    assert cos.shape == sin.shape == (n, hd // 2), (tuple(cos.shape), tuple(x.shape))
    out = torch.empty(xr.shape, dtype=x.dtype, device=x.device)
    pairs = h * hd // 2
    if xr.shape[0]:
        block = min(1024, triton.next_power_of_2(pairs))
        _rope_pairs_kernel[(xr.shape[0], triton.cdiv(pairs, block))](
            xr, cos, sin, out, xr.stride(0), out.stride(0), cos.stride(0), cos.stride(1), n,
            hd // 2, pairs, BLOCK=block)
    return out.view(x.shape)


def rms_norm_rope_pairs(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor
                        ) -> Tensor:
    """x (B, N, H, hd): RMSNorm over each head (weight (hd,)), then its interleaved pairs
    rotated as `rope_pairs` (cos, sin (N, hd/2) float32, strided views alike), all in float32,
    rounded once to x's dtype: a DiT's q/k norm and rope (diffusers: ~8 kernels -> 1)."""
    b, n, h, hd = x.shape
    xr = _rows(x.reshape(b, n, h * hd))
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride() == sin.stride(), \
        (cos.dtype, sin.dtype, cos.stride(), sin.stride())
    assert cos.shape == sin.shape == (n, hd // 2) and weight.shape == (hd,), \
        (tuple(cos.shape), tuple(weight.shape), tuple(x.shape))
    out = torch.empty(xr.shape, dtype=x.dtype, device=x.device)
    if xr.shape[0]:
        _rms_norm_rope_pairs_kernel[(xr.shape[0],)](
            xr, weight, cos, sin, out, xr.stride(0), out.stride(0), cos.stride(0),
            cos.stride(1), n, eps, H=h, HALF=hd // 2, H_P2=triton.next_power_of_2(h),
            HALF_P2=triton.next_power_of_2(hd // 2))
    return out.view(x.shape)


def silu_and_mul(x: Tensor) -> Tensor:
    """(T, 2I) laid out | gate | up | -> silu(gate) * up, (T, I)."""
    xr = _rows(x)
    inter = xr.shape[1] // 2
    out = torch.empty(xr.shape[0], inter, dtype=x.dtype, device=x.device)
    if xr.shape[0]:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(xr.shape[0], triton.cdiv(inter, block))](
            xr, out, xr.stride(0), out.stride(0), inter, BLOCK=block)
    return out.view(*x.shape[:-1], inter)


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor | None, k_weight: Tensor | None,
                 eps: float, cos_cache: Tensor, sin_cache: Tensor, positions: Tensor,
                 axis: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q (T, H, D), k (T, Hkv, D) (rows may be strided views of a fused qkv output) ->
    contiguous rotated q, k. With weights: RMSNorm over each head first (Qwen3's q/k norm).
    cos_cache/sin_cache: (max_position, D) float32; positions (T,). M-RoPE (axis given, (D/2,)
    the position row of each frequency): tables (max_position, D/2), positions (3, T) or (T,)."""
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    q_out = _qk_norm_rope(q, k, None, q_weight, k_weight, eps, cos_cache, sin_cache, positions,
                          axis, k_out, None, None)
    return q_out, k_out


def qk_norm_rope_store(q: Tensor, k: Tensor, v: Tensor, q_weight: Tensor | None,
                       k_weight: Tensor | None, eps: float, cos_cache: Tensor,
                       sin_cache: Tensor, positions: Tensor, axis: Tensor | None,
                       k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> Tensor:
    """`qk_norm_rope`, with the rotated k and v (T, Hkv, D) written into the paged caches
    (num_blocks, block_size, Hkv, D) at slot_mapping (T,) (-1: skipped) -> rotated q."""
    assert v.stride(-1) == 1 and v.shape == k.shape, (v.shape, v.stride())
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert k_cache.shape[2:] == k.shape[1:], (k_cache.shape, k.shape)
    return _qk_norm_rope(q, k, v, q_weight, k_weight, eps, cos_cache, sin_cache, positions,
                         axis, k_cache, v_cache, slot_mapping)


def _qk_norm_rope(q: Tensor, k: Tensor, v: Tensor | None, q_weight: Tensor | None,
                  k_weight: Tensor | None, eps: float, cos_cache: Tensor, sin_cache: Tensor,
                  positions: Tensor, axis: Tensor | None, k_out: Tensor,
                  v_cache: Tensor | None, slot_mapping: Tensor | None) -> Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and head_dim % 2 == 0, (q.stride(), k.stride())
    assert cos_cache.stride(-1) == 1 and cos_cache.stride() == sin_cache.stride()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    has_norm = q_weight is not None
    store = v_cache is not None
    if num_tokens:
        half = head_dim // 2
        v_ = v if v is not None else k
        mrope = axis is not None
        if mrope:
            assert cos_cache.shape[1] == half and axis.shape == (half,), \
                (cos_cache.shape, None if axis is None else axis.shape)
            assert positions.stride(-1) == 1, positions.stride()
        stride_pos = positions.stride(0) if positions.dim() == 2 else 0
        _qk_norm_rope_kernel[(num_tokens,)](
            q, k, v_, q_weight if has_norm else q, k_weight if has_norm else k, cos_cache,
            sin_cache, positions, axis if mrope else positions, q_out, k_out,
            v_cache if store else k_out, slot_mapping if store else positions, q.stride(0),
            q.stride(1), k.stride(0), k.stride(1), v_.stride(0), v_.stride(1),
            cos_cache.stride(0), stride_pos, k_out.stride(1) if store else 0,
            k_out.stride(2) if store else 0, eps, HQ=num_heads, HK=num_kv_heads, HALF=half,
            HQ_P2=triton.next_power_of_2(num_heads), HK_P2=triton.next_power_of_2(num_kv_heads),
            HALF_P2=triton.next_power_of_2(half), HAS_NORM=has_norm, STORE=store, MROPE=mrope,
            **pdl.launch_options(q, "norm"))
    return q_out
