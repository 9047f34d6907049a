"""FP8 attention for diffusion transformers (issue 44): non-causal flash attention whose Q K^T
runs in float8 e4m3 (Hopper / Ada tensor cores, CUDA capability 8.9+), softmax in float32,
P V in bf16, the output in bf16. A stage turns it on with `quantization: {attention: fp8}`;
the DiTs reach it through layers/sequence_parallel.py (`SequenceRanks.attention`).

    q, k, v (B, H, S, D) bf16, key_mask (B, Sk) bool or None
      k := k - mean over the keys of k      (smoothing: softmax(q.(k - c)) = softmax(q.k) for
                                             any c, and K's shared offset no longer eats the
                                             e4m3 range)
      q8 = round_e4m3(q / sq),  sq = amax|q[b, h]| / 448      one scale per (batch, head)
      k8 = round_e4m3(k / sk),  sk = amax|k[b, h]| / 448
      kernel, per (b, h) and tile of BLOCK_M queries, over tiles of BLOCK_N keys:
        s   = (q8 @ k8^T) * sq * sk * softmax_scale           fp8 dot, float32 accumulator
        online softmax in float32 (running max, exp2, rescale of acc and the sum)
        acc += bf16(p) @ v                                    bf16 dot, float32 accumulator
      out = acc / sum (a row whose keys are all masked: 0), stored bf16 (B, S, H, D) memory

Why P V stays in bf16 (and V is not quantized): P lies in [0, 1], where e4m3's three mantissa
bits and its flush below 2^-9 lose the many small probabilities of a long image sequence
(4096+ keys); keeping P V in bf16 keeps the output within the error of Q K^T's quantization.
It also keeps the kernel testable on CPU: Triton 3.6's interpreter rounds float32 -> e4m3
wrongly where the mantissa carries into the exponent (31.6 -> 16, not 32) and wraps past 448,
so the attention kernel converts nothing to fp8 itself: Q and K are quantized in a pass of
their own (`quantize_qk`: scales from PyTorch reductions, then on CUDA one Triton pass,
`_quantize_kernel`, whose e4m3 values equal the PyTorch form's bit for bit (tests/gpu); on CPU
the PyTorch form). The cost: the P V half of the FLOPs runs at bf16 rate.

`fp8_attention_reference` is the same quantization, then attention in float32 from the
dequantized values: the tests' reference and the CPU path (a stage on CPU runs it, slowly).
Padding masks are key masks (B, Sk); other masks (causal, additive) are not served.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max                  # 448
HEAD_DIMS = (64, 128, 256)
LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class Tiles:
    """The kernel's launch shape: queries per program, keys per loop step, warps, stages."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}: {value} is not a power of two >= 16")

    @staticmethod
    def parse(text: str) -> Tiles:
        """`BLOCK_M,BLOCK_N,NUM_WARPS,NUM_STAGES`, e.g. `128,64,8,3` (the benchmark's sweep)."""
        parts = [int(p) for p in text.split(",")]
        if len(parts) != 4:
            raise ValueError(f"tiles {text!r}: expected BLOCK_M,BLOCK_N,NUM_WARPS,NUM_STAGES")
        return Tiles(*parts)


TILES_UP_TO_128 = Tiles(128, 64, 8, 3)
TILES_256 = Tiles(64, 32, 4, 2)


def default_tiles(head_dim: int) -> Tiles:
    """Untuned starting points (the GPU sweep, benchmarks/kernels/fp8_attention.py, decides)."""
    return TILES_UP_TO_128 if head_dim <= 128 else TILES_256


def quantize_heads(x: Tensor, mean: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x - mean (x (B, H, S, D), mean (B, H, 1, D) float32 or None) -> (e4m3 (B, H, S, D),
    scale (B, H) float32): each (batch, head)'s largest magnitude maps to 448. The amax comes
    from reductions of x alone (fl(max x - m) = max fl(x - m): rounding is monotonic), so no
    float32 copy of x is made for it; on CUDA one Triton pass then writes the e4m3 values
    (`_quantize_kernel`, the same float32 arithmetic as the PyTorch form here)."""
    if mean is None:
        amax = torch.linalg.vector_norm(x, float("inf"), dim=(2, 3), dtype=torch.float32)
    else:
        high = x.amax(dim=2, keepdim=True).float() - mean                    # (B, H, 1, D)
        low = mean - x.amin(dim=2, keepdim=True).float()
        amax = torch.maximum(high, low).amax(dim=(2, 3))
    scale = amax.clamp(min=1e-12) / FP8_MAX                                  # (B, H)
    if x.is_cuda:
        return _quantize_cuda(x, mean, scale), scale
    y = x.float() if mean is None else x.float() - mean
    return (y / scale[:, :, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_qk(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Q and K as the kernel reads them: (q8, q_scale, k8, k_scale), K smoothed first (the
    module docstring)."""
    q8, q_scale = quantize_heads(q)
    k8, k_scale = quantize_heads(k, k.mean(dim=2, keepdim=True, dtype=torch.float32))
    return q8, q_scale, k8, k_scale


@triton.jit
def _quantize_kernel(X, Mean, Scale, Out, num_heads, seq, sxb, sxh, sxs, HAS_MEAN: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    pid, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // num_heads, bh % num_heads
    rows = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, HEAD_DIM)
    inside = rows[:, None] < seq
    x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxs + cols[None, :], mask=inside,
                other=0.0).to(tl.float32)
    if HAS_MEAN:
        x = x - tl.load(Mean + bh * HEAD_DIM + cols)[None, :]
    y = tl.math.div_rn(x, tl.load(Scale + bh))          # IEEE division, as PyTorch's
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    tl.store(Out + (bh * seq + rows[:, None]) * HEAD_DIM + cols[None, :], y.to(tl.float8e4nv),
             mask=inside)


def _quantize_cuda(x: Tensor, mean: Tensor | None, scale: Tensor) -> Tensor:
    """(x - mean) / scale clamped to +-448 in e4m3, (B, H, S, D) contiguous: one read of x."""
    b, h, seq, d = x.shape
    assert x.stride(-1) == 1, x.stride()
    out = torch.empty(b, h, seq, d, device=x.device, dtype=FP8)
    block_s = max(1, 4096 // d)
    _quantize_kernel[(triton.cdiv(seq, block_s), b * h)](
        x, mean.contiguous() if mean is not None else scale, scale.contiguous(), out, h, seq,
        *x.stride()[:3], HAS_MEAN=mean is not None, HEAD_DIM=d, BLOCK_S=block_s, num_warps=4)
    return out


def fp8_attention_reference(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None = None,
                            scale: float | None = None) -> Tensor:
    """What the kernel computes, in float32 from the dequantized Q and K (`quantize_qk`),
    in q's dtype: q (B, H, Sq, D), k / v (B, H, Sk, D), key_mask (B, Sk) True on keys to
    attend to. A query whose keys are all masked gets 0 (SDPA gives NaN)."""
    q8, q_scale, k8, k_scale = quantize_qk(q, k)
    qd = q8.float() * q_scale[:, :, None, None]
    kd = k8.float() * k_scale[:, :, None, None]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (qd @ kd.transpose(-1, -2)) * scale                          # (B, H, Sq, Sk)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :].bool(), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (probs @ v.float()).to(q.dtype)


@triton.jit
def _fp8_attention_kernel(Q, K, V, Mask, Out, QScale, KScale, qk_scale, num_heads, len_q, len_k,
                          sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos, smb,
                          HAS_MASK: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // num_heads, bh % num_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :],
                mask=offs_m[:, None] < len_q, other=0.0)                        # (M, D) e4m3
    # dequantization, softmax scale and log2(e) in one factor: exp2 below is exp
    factor = tl.load(QScale + bh) * tl.load(KScale + bh) * qk_scale
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base, v_base = K + b * skb + h * skh, V + b * svb + h * svh
    for start in range(0, len_k, BLOCK_N):
        cols = start + offs_n
        valid = cols < len_k
        k = tl.load(k_base + cols[:, None] * sks + offs_d[None, :], mask=valid[:, None],
                    other=0.0)                                # (N, D) e4m3: K-major for the dot
        s = tl.dot(q, tl.trans(k)) * factor                                     # (M, N) fp32
        if HAS_MASK:
            valid &= tl.load(Mask + b * smb + cols, mask=valid, other=0) != 0
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)    # no valid key yet: exp2 -> 0
        alpha = tl.math.exp2(m_i - m_ref)                       # the running max's rescale
        p = tl.math.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svs + offs_d[None, :], mask=valid[:, None],
                    other=0.0)                                                  # (N, D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=offs_m[:, None] < len_q)


def launch(q8: Tensor, q_scale: Tensor, k8: Tensor, k_scale: Tensor, v: Tensor,
           key_mask: Tensor | None, scale: float, tiles: Tiles) -> Tensor:
    """The kernel on quantized q8 (B, H, Sq, D), k8 (B, H, Sk, D) e4m3 (any strides with a
    unit last one), v (B, H, Sk, D) -> (B, H, Sq, D) in v's dtype, (B, Sq, H, D) in memory."""
    b, h, len_q, d = q8.shape
    len_k = k8.shape[2]
    assert d in HEAD_DIMS, f"head_dim {d}: the kernel takes {HEAD_DIMS}"
    assert q8.stride(-1) == k8.stride(-1) == v.stride(-1) == 1, (q8.stride(), k8.stride(),
                                                                  v.stride())
    out = v.new_empty(b, len_q, h, d).transpose(1, 2)                       # (B, H, Sq, D)
    mask = key_mask.to(torch.uint8) if key_mask is not None else q_scale    # any pointer
    grid = (triton.cdiv(len_q, tiles.block_m), b * h)
    _fp8_attention_kernel[grid](
        q8, k8, v, mask, out, q_scale.contiguous(), k_scale.contiguous(), scale * LOG2E, h,
        len_q, len_k, *q8.stride()[:3], *k8.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        mask.stride(0) if key_mask is not None else 0,
        HAS_MASK=key_mask is not None, HEAD_DIM=d, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def fp8_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None = None,
                  scale: float | None = None, tiles: Tiles | None = None) -> Tensor:
    """Quantize Q and K (`quantize_qk`), then the kernel: q (B, H, Sq, D), k / v (B, H, Sk,
    D) bf16 (or float32 / fp16), key_mask (B, Sk) bool -> (B, H, Sq, D) in v's dtype. On CUDA
    one opaque op to torch.compile (and free of host syncs: CUDA graphs capture it); on CPU
    tensors it runs in Triton's interpreter (TRITON_INTERPRET=1, tests only)."""
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        raise ValueError(f"fp8 attention: head_dim {d} is not one of {HEAD_DIMS}")
    if key_mask is not None and tuple(key_mask.shape) != (k.shape[0], k.shape[2]):
        raise ValueError(f"fp8 attention serves key masks (B, Sk) = {(k.shape[0], k.shape[2])}"
                         f", not a mask of shape {tuple(key_mask.shape)}")
    tiles = tiles or default_tiles(d)
    scale = d ** -0.5 if scale is None else scale
    if not q.is_cuda:
        return launch(*quantize_qk(q, k), v, key_mask, scale, tiles)
    return _attention_op(q, k, v, key_mask, scale, tiles.block_m, tiles.block_n,
                         tiles.num_warps, tiles.num_stages).transpose(1, 2)


@torch.library.custom_op("omnistage::fp8_attention", mutates_args=(), device_types="cuda")
def _attention_op(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, scale: float,
                  block_m: int, block_n: int, num_warps: int, num_stages: int) -> Tensor:
    """quantize_qk and launch() as one op, opaque to torch.compile (whose tracing would not
    see into the Triton passes); returns (B, Sq, H, D), a contiguous result."""
    tiles = Tiles(block_m, block_n, num_warps, num_stages)
    return launch(*quantize_qk(q, k), v, key_mask, scale, tiles).transpose(1, 2)


@_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, scale: float, block_m: int,
      block_n: int, num_warps: int, num_stages: int) -> Tensor:
    b, h, len_q, d = q.shape
    return v.new_empty(b, len_q, h, d)


def attend(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None = None) -> Tensor:
    """A DiT's fp8 attention (B, H, S, D) -> (B, H, S, D): the kernel on CUDA (the stage
    checked the device's capability at load, stages/quantize.attention_method), the
    reference elsewhere."""
    if q.is_cuda:
        return fp8_attention(q, k, v, key_mask)
    return fp8_attention_reference(q, k, v, key_mask)
