"""The Triton kernel of one decoder layer for one-row decode steps, and its helpers: the grid
barrier, weight-tile fetches, the norm's inverse RMS, the chunked matrix-vector phase. The
phases, the barrier's protocol and the numerics are described in triton_decoder_layer.py,
which sizes the tiles and launches `decoder_layer_kernel` once per layer."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from omnistage.layers.triton_decode_attention import (attend_new, attend_tile, kv_tile,
                                                      merge_slices, norm_rope)

NUM_BARRIERS = tl.constexpr(4)   # grid barriers a layer launch passes (after P1 .. P4)
BLOCK_T = tl.constexpr(32)       # keys per attention tile


@triton.jit
def _grid_sync(Count, target):
    """Wait until every program of the grid reached this barrier (see the module doc)."""
    tl.debug_barrier()                                   # this program's stores are issued
    tl.atomic_add(Count, 1, sem="release", scope="gpu")  # ... and visible before the count
    while tl.load(Count, volatile=True) < target:
        pass
    # What follows reads other programs' writes through L2 (`.cg`, the point of coherence)
    # only after this poll saw their counts (loads are not issued speculatively); an acquire
    # here cost another round trip to L2 per barrier (measured: ~0.5 us of ~1.8).
    tl.debug_barrier()


@triton.jit
def _load_w(W, t, kc, N, K: tl.constexpr, ROWS, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            ok):
    """Chunk kc of weight tile t (rows t * ROWS ..): (BLOCK_N, BLOCK_K), zeros outside."""
    i = tl.arange(0, BLOCK_N)
    r = t * ROWS + i
    k = kc * BLOCK_K + tl.arange(0, BLOCK_K)
    m = ((i < ROWS) & (r < N) & ok)[:, None] & (k < K)[None, :]
    return tl.load(W + r[:, None].to(tl.int64) * K + k[None, :], mask=m, other=0.0)


@triton.jit
def _first_tile(W, N, K: tl.constexpr, ROWS, pid, PAIR: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """This program's first weight chunk of a phase (and, PAIR, the up rows' one)."""
    ok = pid < tl.cdiv(N, ROWS)
    w = _load_w(W, pid, 0, N, K, ROWS, BLOCK_N, BLOCK_K, ok)
    w2 = w
    if PAIR:
        w2 = _load_w(W + N * K, pid, 0, N, K, ROWS, BLOCK_N, BLOCK_K, ok)
    return w, w2


@triton.jit
def _inv_rms(X, R, Sum, pid, K: tl.constexpr, eps, ADD: tl.constexpr, K_P2: tl.constexpr):
    """s = X (+ R), rounded to X's dtype; program 0 stores it at Sum; -> 1 / rms(s)."""
    k = tl.arange(0, K_P2)
    m = k < K
    x = tl.load(X + k, mask=m, other=0.0, cache_modifier=".cg")
    if ADD:
        x = (x.to(tl.float32) + tl.load(R + k, mask=m, other=0.0, cache_modifier=".cg"
                                        ).to(tl.float32)).to(X.dtype.element_ty)
    if pid == 0:
        tl.store(Sum + k, x, mask=m)
    xf = x.to(tl.float32)
    return tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)


@triton.jit
def _raw_chunk(X, R, NW, kc, K: tl.constexpr, BLOCK_K: tl.constexpr, ADD: tl.constexpr,
               NORM: tl.constexpr, ok):
    """Chunk kc of a matmul's input vector before the norm: X (+ R, rounded to X's dtype)
    and the norm's weights (NORM), float32. Loaded a chunk ahead of its use (_matvec)."""
    k = kc * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (k < K) & ok
    x = tl.load(X + k, mask=m, other=0.0, cache_modifier=".cg")
    if ADD:
        x = (x.to(tl.float32) + tl.load(R + k, mask=m, other=0.0, cache_modifier=".cg"
                                        ).to(tl.float32)).to(X.dtype.element_ty)
    x = x.to(tl.float32)
    nw = x
    if NORM:
        nw = tl.load(NW + k, mask=m, other=0.0).to(tl.float32)
    return x, nw


@triton.jit
def _finish_chunk(x, nw, inv, NORM: tl.constexpr, dt: tl.constexpr):
    """A raw chunk normalised by inv and times the norm's weights, rounded as the norm rounds."""
    if NORM:
        x = ((x * inv).to(dt).to(tl.float32) * nw).to(dt).to(tl.float32)
    return x


@triton.jit
def _matvec(W, B, X, R, NW, inv, Out, w, w2, x, nw, N, K: tl.constexpr, ROWS, pid, nprog,
            ADD: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr, PAIR: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Out[n] = W[n] . x for the tiles pid, pid + nprog, ... (w, w2: the first weight chunk,
    x, nw: the first input chunk (_raw_chunk), fetched by the caller; each iteration fetches
    the next of both). PAIR: W holds N gate rows then N up rows; Out[n] = silu(gate) * up."""
    dt = Out.dtype.element_ty
    KC: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    total = (tl.cdiv(N, ROWS) - pid + nprog - 1) // nprog * KC
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    for i in range(0, total):
        j = i + 1                                        # the next chunk, in flight meanwhile
        t_next = pid + (j // KC) * nprog
        w_next = _load_w(W, t_next, j % KC, N, K, ROWS, BLOCK_N, BLOCK_K, j < total)
        w2_next = w_next
        if PAIR:
            w2_next = _load_w(W + N * K, t_next, j % KC, N, K, ROWS, BLOCK_N, BLOCK_K,
                              j < total)
        x_next, nw_next = _raw_chunk(X, R, NW, j % KC, K, BLOCK_K, ADD, NORM, j < total)
        kc = i % KC
        xf = _finish_chunk(x, nw, inv, NORM, dt)
        acc += tl.sum(w.to(tl.float32) * xf[None, :], 1)
        if PAIR:
            acc2 += tl.sum(w2.to(tl.float32) * xf[None, :], 1)
        if kc == KC - 1:
            lane = tl.arange(0, BLOCK_N)
            r = (pid + (i // KC) * nprog) * ROWS + lane
            r_ok = (lane < ROWS) & (r < N)
            if HAS_BIAS:
                acc += tl.load(B + r, mask=r_ok, other=0.0).to(tl.float32)
            y = acc
            if PAIR:
                gate = acc.to(dt).to(tl.float32)
                up = acc2.to(dt).to(tl.float32)
                y = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up
            tl.store(Out + r, y.to(dt), mask=r_ok)
            acc = tl.zeros([BLOCK_N], tl.float32)
            acc2 = tl.zeros([BLOCK_N], tl.float32)
        w = w_next
        w2 = w2_next
        x = x_next
        nw = nw_next


@triton.jit(do_not_specialize=["nprog", "stride_cos", "stride_cb", "eps", "qk_eps"])
def decoder_layer_kernel(
        X, R, RMid, ROut, XOut,
        NW1, Wqkv, Bqkv, QNW, KNW, Wo, Bo, NW2, Wgu, Wd,
        Cos, Sin, Pos, Slot, SeqLens, Table, Kc, Vc,
        QKV, OPart, Lse, Attn, O, Act, Count, GCount,
        nprog, stride_cos, stride_cb, eps, qk_eps, qk_scale,
        HID: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
        INTER: tl.constexpr, PAGE: tl.constexpr, S: tl.constexpr,
        ROWS_QKV: tl.constexpr, BN_QKV: tl.constexpr, BK_QKV: tl.constexpr,
        ROWS_O: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
        ROWS_GU: tl.constexpr, BN_GU: tl.constexpr, BK_GU: tl.constexpr,
        ROWS_D: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr,
        FIRST: tl.constexpr, QKV_BIAS: tl.constexpr, O_BIAS: tl.constexpr,
        QK_NORM: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
        SKIP: tl.constexpr = 0):
    # SKIP (benchmarks/kernels/layer_kernel.py only; wrong results): 1 no grid barriers,
    # 2 no attention phase, 4 no matmul phases
    pid = tl.program_id(0)
    G: tl.constexpr = HQ // HKV
    G_P2: tl.constexpr = triton.next_power_of_2(G)
    M: tl.constexpr = G_P2 if G_P2 > 16 else 16          # rows of the q tile (tl.dot: >= 16)
    D_P2: tl.constexpr = triton.next_power_of_2(D)
    HID_P2: tl.constexpr = triton.next_power_of_2(HID)
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D

    w, w2 = _first_tile(Wqkv, NQKV, HID, ROWS_QKV, pid, False, BN_QKV, BK_QKV)
    if PDL:
        gdc_wait()                     # the previous kernel's writes are visible from here
    base = tl.atomic_add(Count, 0, sem="acquire", scope="gpu")
    base = base - base % (NUM_BARRIERS * nprog)
    if PDL:
        gdc_launch_dependents()        # the next layer may launch and fetch its weights

    # the attention's inputs from the host (the step's position, slot, length) and the first
    # cached key/value tile of this program's first task: fetched before P1 and barrier 1
    pos = tl.load(Pos).to(tl.int64)
    slot = tl.load(Slot).to(tl.int64)
    seq_len = tl.load(SeqLens)
    ctx = seq_len - 1                                    # positions already in the cache
    per = tl.cdiv(tl.cdiv(seq_len, BLOCK_T), S) * BLOCK_T
    num_tasks = HKV * S if SKIP & 2 == 0 else 0
    d = tl.arange(0, D_P2)
    d_ok = d < D
    cos = tl.load(Cos + pos * stride_cos + d, mask=d_ok, other=0.0)
    sin = tl.load(Sin + pos * stride_cos + d, mask=d_ok, other=0.0)
    lo0 = (pid % S) * per
    k_pre, v_pre, n_pre = kv_tile(Kc, Vc, Table, lo0, tl.minimum(tl.minimum(seq_len, lo0 + per),
                                                                 ctx),
                                  pid // S, stride_cb, HKV, D, D_P2, PAGE, BLOCK_T,
                                  pid < num_tasks)

    # P1: s = h + residual -> RMid; qkv = norm(s) Wqkv^T
    x, nw = _raw_chunk(X, R, NW1, 0, HID, BK_QKV, not FIRST, True, True)
    inv = _inv_rms(X, R, RMid, pid, HID, eps, not FIRST, HID_P2)
    if SKIP & 4 == 0:
        _matvec(Wqkv, Bqkv, X, R, NW1, inv, QKV, w, w2, x, nw, NQKV, HID, ROWS_QKV, pid,
                nprog, not FIRST, True, QKV_BIAS, False, BN_QKV, BK_QKV)
    if SKIP & 1 == 0:
        _grid_sync(Count, base + nprog)

    # P2: attention, task (KV head g, slice j) for g < HKV, j < S
    dt = QKV.dtype.element_ty
    gi = tl.arange(0, M)
    for task in range(pid, num_tasks, nprog):
        g = task // S
        j = task % S
        hq = g * G + gi
        hq_ok = gi < G
        q = norm_rope(QKV, hq, hq_ok, D, QNW, cos, sin, qk_eps, D, D_P2, QK_NORM)  # (M, D)
        qd = q.to(dt)
        one = tl.arange(0, 1)
        k_new = norm_rope(QKV + HQ * D, g + one, one < 1, D, KNW, cos, sin, qk_eps, D, D_P2,
                          QK_NORM)                                               # (1, D)
        v_new = tl.load(QKV + (HQ + HKV) * D + g * D + d[None, :], mask=d_ok[None, :],
                        other=0.0, cache_modifier=".cg").to(tl.float32)          # (1, D)
        if (j == 0) & (slot >= 0):
            dst = slot * (HKV * D) + g * D + d[None, :]
            tl.store(Kc + dst, k_new.to(dt), mask=d_ok[None, :])
            tl.store(Vc + dst, v_new.to(dt), mask=d_ok[None, :])
        lo = j * per
        hi = tl.minimum(seq_len, lo + per)
        cached_hi = tl.minimum(hi, ctx)
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D_P2], tl.float32)
        if task == pid:                                  # fetched before barrier 1
            k, v, n_ok = k_pre, v_pre, n_pre
        else:
            k, v, n_ok = kv_tile(Kc, Vc, Table, lo, cached_hi, g, stride_cb, HKV, D, D_P2,
                                 PAGE, BLOCK_T, True)
        for start in range(lo, cached_hi, BLOCK_T):
            nxt = start + BLOCK_T                        # the next tile, in flight meanwhile
            k_n, v_n, n_ok_n = kv_tile(Kc, Vc, Table, nxt, cached_hi, g, stride_cb, HKV, D,
                                       D_P2, PAGE, BLOCK_T, nxt < cached_hi)
            m_i, l_i, acc = attend_tile(qd, k, v, n_ok, m_i, l_i, acc, qk_scale, IEEE)
            k, v, n_ok = k_n, v_n, n_ok_n
        # the new token (position ctx) belongs to the slice that holds it
        m_i, l_i, acc = attend_new(q, k_new, v_new, (ctx >= lo) & (ctx < hi), m_i, l_i, acc,
                                   qk_scale, dt)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_i))
        tl.store(Lse + hq * S + j, lse, mask=hq_ok)
        tl.store(OPart + (hq[:, None] * S + j) * D_P2 + d[None, :], out, mask=hq_ok[:, None])
        # the KV head's last slice to finish merges the slices
        tl.debug_barrier()
        done = tl.atomic_add(GCount + g, 1, sem="acq_rel", scope="gpu")
        if done % S == S - 1:
            tl.debug_barrier()
            g2 = tl.arange(0, G_P2)                      # only the G real rows
            merged = merge_slices(OPart, Lse, g * G + g2, g2 < G, S, D_P2)
            tl.store(Attn + (g * G + g2)[:, None] * D + d[None, :], merged.to(dt),
                     mask=(g2 < G)[:, None] & d_ok[None, :])
    w, w2 = _first_tile(Wo, HID, HQ * D, ROWS_O, pid, False, BN_O, BK_O)
    if SKIP & 1 == 0:
        _grid_sync(Count, base + 2 * nprog)

    # P3: o = attn Wo^T
    x, nw = _raw_chunk(Attn, Attn, NW1, 0, HQ * D, BK_O, False, False, True)
    if SKIP & 4 == 0:
        _matvec(Wo, Bo, Attn, Attn, NW1, 1.0, O, w, w2, x, nw, HID, HQ * D, ROWS_O, pid,
                nprog, False, False, O_BIAS, False, BN_O, BK_O)
    w, w2 = _first_tile(Wgu, INTER, HID, ROWS_GU, pid, True, BN_GU, BK_GU)
    if SKIP & 1 == 0:
        _grid_sync(Count, base + 3 * nprog)

    # P4: s2 = o + s -> ROut; act = silu(gate) * up of norm(s2) Wgu^T
    x, nw = _raw_chunk(O, RMid, NW2, 0, HID, BK_GU, True, True, True)
    inv = _inv_rms(O, RMid, ROut, pid, HID, eps, True, HID_P2)
    if SKIP & 4 == 0:
        _matvec(Wgu, Wgu, O, RMid, NW2, inv, Act, w, w2, x, nw, INTER, HID, ROWS_GU, pid,
                nprog, True, True, False, True, BN_GU, BK_GU)
    w, w2 = _first_tile(Wd, HID, INTER, ROWS_D, pid, False, BN_D, BK_D)
    if SKIP & 1 == 0:
        _grid_sync(Count, base + 4 * nprog)

    # P5: h' = act Wd^T (the layer's output is h' + s2)
    x, nw = _raw_chunk(Act, Act, NW1, 0, INTER, BK_D, False, False, True)
    if SKIP & 4 == 0:
        _matvec(Wd, Wd, Act, Act, NW1, 1.0, XOut, w, w2, x, nw, HID, INTER, ROWS_D, pid,
                nprog, False, False, False, False, BN_D, BK_D)
