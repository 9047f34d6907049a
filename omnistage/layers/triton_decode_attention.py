"""One kernel for the attention of a small decode batch (CUDA; Triton's interpreter on CPU):
q/k RMSNorm + rotary, the new K/V into the paged cache, attention over the context split into
slices, and the merge of the slices.

The per-op path runs three kernels there (qk_norm_rope_store, the split-K paged attention, the
combine), each a few microseconds that a single stream pays 28 times a token. Here one launch
of (slices, KV heads, sequences) programs does it all:

    program (j, g, b): slice j of sequence b's context, KV head g and its G query heads
      1. cos/sin of b's position, the first cached K/V tile of the slice (before waiting on
         the previous kernel: no kernel of the step writes them; each tile then fetches the
         next)
      2. q (G heads) and k of head g: RMSNorm (Qwen3) and rotary, from the q/k/v projection;
         slice 0 writes k and v into the cache slot
      3. online softmax over the slice's cached keys (tensor-core tiles: the G query heads
         padded to 16 rows), plus the new key if the slice holds its position -> partial
         output and log-sum-exp
      4. the slice to finish last for (b, g) (a counter per (b, g), reset by that slice)
         merges the partial outputs of all slices into the output

With one slice there is nothing to merge. The grid has MAX_SPLITS slices (fixed when a CUDA
graph is captured); a launch uses as few of them as hold its context in whole BLOCK_T tiles
(the others are empty and merge as nothing), so up to MAX_SPLITS x BLOCK_T keys every cached
key is fetched before the wait.

Used by default for one row on an H100 (`fused.decode_attention_for`), where the kernels of
a step launch their dependents early (pdl.py): the 28 layers took 628 us with it at 128 keys
a tile in 8 warps, 674 at 32 keys in 4 warps, 733 with the three kernels (a context of 256;
benchmarks/results/runs/pdl_early_h100/). Without early launch it was no faster than the
three kernels. The helpers (`norm_rope`, `kv_tile`, `attend_tile`, `merge_slices`) are shared
with the one-kernel-a-layer path (triton_decoder_layer.py).
Partial results written by other programs are read through L2 (`.cg`) after the counter's
acquire. Numerics are the per-op path's: q and k rounded to the input dtype after rotary,
scores and softmax in float32, probabilities rounded to the dtype before P @ V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from torch import Tensor

from omnistage.layers import pdl

# H100, one row inside the whole step (kernels/layer_kernel.py --attention-variants): 128 keys
# in 8 warps 628 us for the layers, 64 in 8 656, 128 in 16 645, 32 in 4 674; 4 or 8 slices
# alike at a context of 256. 128 keys in 8 warps spill a few registers (ptxas), and still win.
BLOCK_T = 128                  # keys per tile (at least 16: tl.dot)
NUM_WARPS = 8
MAX_SPLITS = 8                 # slices at most (and at most the per-op path's)


@triton.jit
def kv_tile(Kc, Vc, Table, start, end, g, stride_cb, HKV: tl.constexpr, D: tl.constexpr,
            D_P2: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr, ok):
    """Cached keys and values start .. end-1 (< start + BLOCK_T) of KV head g, from the pages
    of the block table: (BLOCK_T, D_P2) each, zeros outside; their mask (BLOCK_T,)."""
    n = start + tl.arange(0, BLOCK_T)
    n_ok = (n < end) & ok
    d = tl.arange(0, D_P2)
    page = tl.load(Table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
    off = page * stride_cb + (n % PAGE) * (HKV * D) + g * D
    m = n_ok[:, None] & (d < D)[None, :]
    k = tl.load(Kc + off[:, None] + d[None, :], mask=m, other=0.0)
    v = tl.load(Vc + off[:, None] + d[None, :], mask=m, other=0.0)
    return k, v, n_ok


@triton.jit
def norm_rope(Src, rows, row_ok, stride_h, NW, cos, sin, eps, D: tl.constexpr,
              D_P2: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads `rows` of Src (stride_h apart): RMSNorm over each (if HAS_NORM), then
    rotate-half rotary with the position's cos/sin rows (D_P2,) -> (len(rows), D_P2) float32,
    rounded to Src's dtype."""
    dt = Src.dtype.element_ty
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, D_P2)
    d_ok = d < D
    pd = tl.where(d < HALF, d + HALF, d - HALF)          # the partner in rotate_half
    m = row_ok[:, None] & d_ok[None, :]
    base = Src + rows[:, None] * stride_h
    x = tl.load(base + d[None, :], mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    xp = tl.load(base + pd[None, :], mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        w = tl.load(NW + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(NW + pd, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x = ((x * inv).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        xp = ((xp * inv).to(dt).to(tl.float32) * wp).to(dt).to(tl.float32)
    out = tl.where((d < HALF)[None, :], x * cos[None, :] - xp * sin[None, :],
                   x * cos[None, :] + xp * sin[None, :])
    return out.to(dt).to(tl.float32)


@triton.jit
def attend_tile(q, k, v, n_ok, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr):
    """One online-softmax step on tensor cores: q (M >= 16, D) in the inputs' dtype against a
    tile of keys/values (T >= 16, D) with mask n_ok (T,) -> updated (running max, running sum,
    accumulator); scores in log2 units. IEEE: float32 inputs multiply in full float32."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))                     # (M, T)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def attend_new(q, k_new, v_new, own, m_i, l_i, acc, qk_scale, dt: tl.constexpr):
    """The online-softmax step for the new token's key/value (1, D), if `own`."""
    s_new = tl.sum(q * k_new, 1) * qk_scale                                       # (G,)
    s_new = tl.where(own, s_new, float("-inf"))
    m_new = tl.maximum(m_i, s_new)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p_new = tl.math.exp2(s_new - m_safe)
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + p_new
    return m_new, l_i, acc * alpha[:, None] + p_new.to(dt).to(tl.float32)[:, None] * v_new


@triton.jit
def merge_slices(OPart, Lse, hq, hq_ok, S: tl.constexpr, D_P2: tl.constexpr):
    """The S partial outputs of heads hq (rows (hq * S + slice) * D_P2 of OPart, their
    log2-sum-exps at Lse + hq * S + slice), written by other programs: softmax-weighted
    sum -> (G, D_P2) float32 (zeros where every slice was empty)."""
    sp = tl.arange(0, S)
    d = tl.arange(0, D_P2)
    lse = tl.load(Lse + hq[:, None] * S + sp[None, :], mask=hq_ok[:, None],
                  other=float("-inf"), cache_modifier=".cg")                      # (G, S)
    mx = tl.max(lse, 1)
    wt = tl.math.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx)[:, None])
    part = tl.load(OPart + (hq[:, None, None] * S + sp[None, :, None]) * D_P2 + d[None, None, :],
                   mask=hq_ok[:, None, None], other=0.0, cache_modifier=".cg")    # (G, S, D)
    tot = tl.sum(wt, 1)
    return tl.sum(part * wt[:, :, None], 1) / tl.where(tot == 0.0, 1.0, tot)[:, None]


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_attention_kernel(
        Q, K, V, QW, KW, Cos, Sin, Pos, Slot, SeqLens, Table, Kc, Vc, Out, OPart, Lse, Count,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_ot, stride_oh,
        stride_cos, stride_cb, stride_bt, eps, qk_scale,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
        S: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr,
        PDL: tl.constexpr):
    if PDL == 2:
        gdc_launch_dependents()
    j = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2)
    G: tl.constexpr = HQ // HKV
    G_P2: tl.constexpr = triton.next_power_of_2(G)
    M: tl.constexpr = G_P2 if G_P2 > 16 else 16          # rows of the q tile (tl.dot: >= 16)
    D_P2: tl.constexpr = triton.next_power_of_2(D)
    dt = Q.dtype.element_ty
    # 1. what no kernel of the step writes (host inputs, tables, keys of earlier steps)
    pos = tl.load(Pos + b).to(tl.int64)
    slot = tl.load(Slot + b).to(tl.int64)
    seq_len = tl.load(SeqLens + b)
    ctx = seq_len - 1                                    # positions already in the cache
    # slices in use: as few as hold the context in whole tiles (S at most; the rest are empty
    # and merge as nothing), so a short context is fetched in one tile a slice, before the wait
    used = tl.maximum(tl.minimum(S, tl.cdiv(seq_len, BLOCK_T)), 1)
    per = tl.cdiv(tl.cdiv(seq_len, used), 16) * 16       # keys a slice (whole 16s)
    lo = j * per
    hi = tl.minimum(seq_len, lo + per)
    cached_hi = tl.minimum(hi, ctx)
    d = tl.arange(0, D_P2)
    d_ok = d < D
    cos = tl.load(Cos + pos * stride_cos + d, mask=d_ok, other=0.0)
    sin = tl.load(Sin + pos * stride_cos + d, mask=d_ok, other=0.0)
    table = Table + b.to(tl.int64) * stride_bt
    k, v, n_ok = kv_tile(Kc, Vc, table, lo, cached_hi, g, stride_cb, HKV, D, D_P2, PAGE,
                         BLOCK_T, True)
    if PDL:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()
    # 2. q, k normalised and rotated; slice 0 stores k, v
    gi = tl.arange(0, M)
    hq = g * G + gi
    hq_ok = gi < G
    q = norm_rope(Q + b.to(tl.int64) * stride_qt, hq, hq_ok, stride_qh, QW, cos, sin, eps, D,
                  D_P2, HAS_NORM)                                    # (M, D): rows >= G zero
    qd = q.to(dt)
    one = tl.arange(0, 1)
    k_new = norm_rope(K + b.to(tl.int64) * stride_kt, g + one, one < 1, stride_kh, KW, cos,
                      sin, eps, D, D_P2, HAS_NORM)                                # (1, D)
    v_new = tl.load(V + b.to(tl.int64) * stride_vt + g * D + d[None, :], mask=d_ok[None, :],
                    other=0.0).to(tl.float32)                                     # (1, D)
    if (j == 0) & (slot >= 0):
        dst = slot * (HKV * D) + g * D + d[None, :]
        tl.store(Kc + dst, k_new.to(dt), mask=d_ok[None, :])
        tl.store(Vc + dst, v_new.to(dt), mask=d_ok[None, :])
    # 3. this slice
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D_P2], tl.float32)
    for start in range(lo, cached_hi, BLOCK_T):
        nxt = start + BLOCK_T                            # the next tile, in flight meanwhile
        k_n, v_n, n_ok_n = kv_tile(Kc, Vc, table, nxt, cached_hi, g, stride_cb, HKV, D, D_P2,
                                   PAGE, BLOCK_T, nxt < cached_hi)
        m_i, l_i, acc = attend_tile(qd, k, v, n_ok, m_i, l_i, acc, qk_scale, IEEE)
        k, v, n_ok = k_n, v_n, n_ok_n
    m_i, l_i, acc = attend_new(q, k_new, v_new, (ctx >= lo) & (ctx < hi), m_i, l_i, acc,
                               qk_scale, dt)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = Out + b.to(tl.int64) * stride_ot + hq[:, None] * stride_oh + d[None, :]
    o_mask = hq_ok[:, None] & d_ok[None, :]
    if S == 1:
        tl.store(o_ptrs, out.to(dt), mask=o_mask)
    else:
        # 4. partial results; the last slice of (b, g) to finish merges them
        rows = b * HQ + hq
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_i))
        tl.store(Lse + rows * S + j, lse, mask=hq_ok)
        tl.store(OPart + (rows[:, None] * S + j) * D_P2 + d[None, :], out, mask=hq_ok[:, None])
        tl.debug_barrier()
        counter = Count + b * HKV + g
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == S - 1:
            tl.debug_barrier()
            g2 = tl.arange(0, G_P2)                      # only the G real rows
            merged = merge_slices(OPart, Lse, b * HQ + g * G + g2, g2 < G, S, D_P2)
            tl.store(Out + b.to(tl.int64) * stride_ot + (g * G + g2)[:, None] * stride_oh
                     + d[None, :], merged.to(dt), mask=(g2 < G)[:, None] & d_ok[None, :])
            tl.store(counter, 0)        # ready for the next launch (stream-ordered after this)


class DecodeAttention:
    """The launcher, with its per-(sequence, KV head) counters (allocated zeroed once, per
    device; each launch leaves them at zero)."""

    def __init__(self) -> None:
        self._counts: dict[torch.device, Tensor] = {}

    def counts(self, device: torch.device, n: int) -> Tensor:
        c = self._counts.get(device)
        if c is None or c.numel() < n:
            c = self._counts[device] = torch.zeros(max(n, 256), dtype=torch.int64,
                                                   device=device)
        return c

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, q_weight: Tensor | None,
                 k_weight: Tensor | None, eps: float, cos: Tensor, sin: Tensor,
                 positions: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                 seq_lens: Tensor, block_tables: Tensor, scale: float, splits: int) -> Tensor:
        """q (B, H, D), k/v (B, Hkv, D): one new token for each of B sequences (rows may be
        strided views of one q/k/v buffer); cos/sin (P, D); positions, slot_mapping (B,)
        (slot -1: padding, nothing stored); seq_lens (B,) with the new token (0: padding);
        block_tables (B, W). -> attention output (B, H, D)."""
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        assert splits & (splits - 1) == 0 and positions.dim() == 1, (splits, positions.shape)
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and v.stride(1) == head_dim
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        assert cos.shape[1] == head_dim and cos.stride() == sin.stride(), cos.shape
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        d_p2 = triton.next_power_of_2(head_dim)
        part = lse = out
        count = out
        if splits > 1:
            part = torch.empty(num_seqs * num_heads * splits * d_p2, dtype=torch.float32,
                               device=q.device)
            lse = torch.empty(num_seqs * num_heads * splits, dtype=torch.float32,
                              device=q.device)
            count = self.counts(q.device, num_seqs * num_kv_heads)
        has_norm = q_weight is not None
        _decode_attention_kernel[(splits, num_kv_heads, num_seqs)](
            q, k, v, q_weight if has_norm else q, k_weight if has_norm else k, cos, sin,
            positions, slot_mapping, seq_lens, block_tables, k_cache, v_cache, out, part, lse,
            count, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            out.stride(0), out.stride(1), cos.stride(0), k_cache.stride(0),
            block_tables.stride(0), eps, scale * 1.4426950408889634,
            HQ=num_heads, HKV=num_kv_heads, D=head_dim, PAGE=k_cache.shape[1], S=splits,
            HAS_NORM=has_norm, BLOCK_T=BLOCK_T, IEEE=q.dtype == torch.float32,
            num_warps=NUM_WARPS,
            **pdl.launch_options(q, "attention"))
        return out
