"""Triton paged attention for CUDA: one kernel over the paged KV cache for any mix of prefill
chunks and decodes, reading K/V straight through the block table (no gather).

Work is split into programs, each one (sequence, block of query tokens, KV head). A program
stacks its query tokens and the G = H / Hkv query heads that share its KV head into the rows of
one tile, so grouped-query attention reads every key and value once per group:

    rows of a program's Q tile (G = 2, BLOCK_Q = 8 tokens -> BLOCK_M = 16 rows)
      row:   0    1    2    3   ...  14   15
      token: q0   q0   q0+1 q0+1 ... q0+7 q0+7
      head:  g*2  g*2+1 g*2 g*2+1 ... g*2 g*2+1          (g = this program's KV head)

    for each tile of BLOCK_N keys 0 .. (last position of these queries):
        block_tables[seq, n // block_size] -> page; K/V rows loaded from the cache pages
        scores = Q @ K^T (causal: key position <= query position), online softmax, acc += P @ V

Two launches a step at most: "decode" programs (sequences with at most BLOCK_M / G new tokens,
one program per sequence and KV head, BLOCK_M = 16) and "prefill" programs (longer chunks, 64-row
tiles). Which sequence and first query token a program takes comes from a small work table that
`prepare` builds on the host once per step, so the per-layer calls do no host work. The kernels
read lengths from device tensors only: a decode batch captured in a CUDA graph replays with new
sequence lengths and block tables, and padding rows (seq_lens 0, slot -1) write nothing and
attend to nothing.

Split-K: a batch of pure decodes too small to fill the device (batch x Hkv programs under half
the multiprocessors, e.g. a single stream) splits each context into up to MAX_SPLITS (8)
slices of whole key tiles, one program each; each writes its normalised partial output and
log-sum-exp, and `_combine_splits_kernel` merges them (an empty slice has weight 0). A
captured graph's split count comes from its bucket size alone; slices past a shorter context
are empty. Where `fused.decode_attention_for` says so (one row on an H100 or H200 by default)
such a batch with plain rotary takes `rotate_and_attend` instead: the q/k norm, rotary, K/V
store, sliced attention and merge in one kernel (triton_decode_attention.py).

New K/V are first written into the cache by `_store_kv_kernel` (slot -1: skipped), then attended
like the rest of the context, so a fresh prefill and a chunk on top of a cached prefix are one
case. float32 inputs use IEEE float32 dots (not tf32), so fp32 engines stay exact enough for
greedy golden tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from torch import Tensor

from omnistage.layers import pdl
from omnistage.layers import triton_decode_attention as tda
from omnistage.layers.attention_backend import AttentionMetadata, TorchPagedAttention

DECODE_BLOCK_M = 16    # rows of a decode tile: tl.dot needs at least 16
PREFILL_BLOCK_M = 64
BLOCK_N = 64           # keys per tile (any block_size: each key finds its page)
# split-K programs per (sequence, KV head) for small decode batches: a single stream on an H100
# made 1113-1115 tok/s with 8 against 1085-1086 with 16 and 1056 with 4 (alternating runs in
# one call, benchmarks/results/runs/kv_splits_h100/)
MAX_SPLITS = 8


@triton.jit
def _store_kv_kernel(K, V, K_cache, V_cache, slot_mapping,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                     HKV: tl.constexpr, D: tl.constexpr, HKV_P2: tl.constexpr,
                     D_P2: tl.constexpr):
    """One program per new token: its K and V (Hkv, D) go to cache slot slot_mapping[t]."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    h = tl.arange(0, HKV_P2)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    mask = (h < HKV) & (d < D) & (slot >= 0)
    k = tl.load(K + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(V + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    dst = slot * stride_cs + h * stride_ch + d
    tl.store(K_cache + dst, k, mask=mask)
    tl.store(V_cache + dst, v, mask=mask)


# Lengths that change from step to step are not specialised on (no recompiles mid-run).
@triton.jit(do_not_specialize=["num_work", "stride_bt"])
def _paged_attention_kernel(
        Q, K_cache, V_cache, Out, O_part, LSE, block_tables, seq_lens, query_start_loc, work,
        num_work, qk_scale,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
        stride_pt, stride_ph, stride_lt, stride_lh,
        G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, D_P2: tl.constexpr, IEEE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, PDL: tl.constexpr):
    if PDL == 2:   # launched early behind the previous kernel (pdl.py): wait for its writes
        gdc_launch_dependents()
    if PDL:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(work + pid)
    q0 = tl.load(work + num_work + pid)            # this program's first query token
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    seq_len = tl.load(seq_lens + seq)
    ctx = seq_len - q_len                          # tokens cached before this step

    rows = tl.arange(0, BLOCK_M)
    tok = q0 + rows // G
    head = kvh * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (tok < q_len)
    q_pos = ctx + tok                              # absolute position of each row's query
    d = tl.arange(0, D_P2)
    d_ok = d < D
    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)       # (M, D)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P2], tl.float32)
    kv_end = tl.minimum(seq_len, ctx + q0 + BLOCK_Q)   # the last query here sees up to this
    kv_lo = 0
    if NUM_SPLITS > 1:   # this program takes one slice of whole key tiles
        per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SPLITS) * BLOCK_N
        kv_lo = split * per_split
        kv_end = tl.minimum(kv_end, kv_lo + per_split)
    table = block_tables + seq.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        page = tl.load(table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        off = page * stride_cb + (n % PAGE) * stride_cs + kvh * stride_ch     # (N,)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K_cache + off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # (N, D)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale                                                   # log2 domain
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)             # rows with no key yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_cache + off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # (N, D)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]    # padding rows: zeros
    if NUM_SPLITS > 1:   # partial result and its log2-sum-exp, merged by the combine kernel
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_i))
        tl.store(LSE + q_row * stride_lt + head * stride_lh + split, lse, mask=row_ok)
        tl.store(O_part + q_row[:, None] * stride_pt + head[:, None] * stride_ph
                 + split * D_P2 + d[None, :], out, mask=row_ok[:, None])
    else:
        tl.store(Out + q_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_work"])
def _combine_splits_kernel(O_part, LSE, Out, query_start_loc, work, num_work,
                           stride_pt, stride_ph, stride_lt, stride_lh, stride_ot, stride_oh,
                           D: tl.constexpr, D_P2: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           PDL: tl.constexpr):
    """Out[t, h] = sum over splits of softmax-weighted partial outputs (one query a program)."""
    if PDL == 2:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()
    seq = tl.load(work + tl.program_id(0))
    h = tl.program_id(1)
    t = tl.load(query_start_loc + seq).to(tl.int64)
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D_P2)
    lse = tl.load(LSE + t * stride_lt + h * stride_lh + sp)                 # (S,)
    m = tl.max(lse, 0)
    w = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))            # empty split: 0
    part = tl.load(O_part + t * stride_pt + h * stride_ph + sp[:, None] * D_P2 + d[None, :])
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + t * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < D)


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
             ) -> None:
    """Write k/v (T, Hkv, D) into the caches (num_blocks, block_size, Hkv, D) at slot_mapping
    (T,); rows with slot -1 are skipped (CUDA-graph padding)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k/v rows must be contiguous in head_dim"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), k_cache.stride(1), k_cache.stride(2), HKV=num_kv_heads, D=head_dim,
        HKV_P2=triton.next_power_of_2(num_kv_heads), D_P2=triton.next_power_of_2(head_dim))


@dataclass(slots=True)
class _Launch:
    work: Tensor          # (2 * n,) int32: sequence of each program, then its first query token
    num_programs: int
    block_m: int
    num_splits: int = 1   # > 1: split-K over the context (pure decodes only), then combine


@dataclass(slots=True)
class _TritonState:
    group: int            # the G = H / Hkv the decode/prefill split was planned for
    launches: list[_Launch]


def _block_m(kind_block_m: int, group: int) -> int:
    return max(kind_block_m, triton.next_power_of_2(group))


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split-K for decode batches too small to fill the device: each (sequence, KV head) gets
    up to MAX_SPLITS programs over slices of its context, while that still leaves at least
    two programs a multiprocessor would otherwise idle; never more splits than key tiles."""
    programs = num_seqs * num_kv_heads
    if 2 * programs > num_sms:
        return 1
    tiles = -(-max_seq_len // BLOCK_N)
    splits = min(MAX_SPLITS, tiles, num_sms // programs)
    return 1 << (max(splits, 1).bit_length() - 1)   # a power of two (the combine's arange)


class TritonPagedAttention:
    """Paged attention through the Triton kernels above (CUDA, or the Triton interpreter on
    CPU tensors). Graph-safe: `forward` only launches kernels on tensors fixed by `prepare`."""

    supports_cuda_graphs = True
    supports_prefill_graphs = True   # static_prefill_state, prefill_work (ar/prefill_graphs.py)
    accepts_stored_kv = True     # forward(..., kv_stored=True): the new K/V are in the cache

    def __init__(self, block_size: int = 16, num_queries_per_kv: int = 1,
                 num_kv_heads: int | None = None, num_sms: int | None = None) -> None:
        """num_kv_heads and num_sms (multiprocessors; None: read from the device) decide
        split-K for small decode batches; without num_kv_heads there is no split-K."""
        self.block_size = block_size
        self.num_queries_per_kv = num_queries_per_kv   # G; corrected by the first forward
        self.num_kv_heads = num_kv_heads
        self.num_sms = num_sms
        self._fallback = TorchPagedAttention(block_size)
        self._decode = tda.DecodeAttention()

    def prepare(self, md: AttentionMetadata, has_cache: bool) -> None:
        """Build the work tables of the step's (at most two) launches, in one host-to-device
        copy. How many query tokens fit a program depends on G: a state planned for another G
        is re-planned by `forward` (once; later steps plan with the G it saw)."""
        md.backend_state = self._plan(md, self.num_queries_per_kv)

    def _plan(self, md: AttentionMetadata, group: int) -> _TritonState:
        dec_m, pre_m = _block_m(DECODE_BLOCK_M, group), _block_m(PREFILL_BLOCK_M, group)
        dec_q, pre_q = dec_m // group, pre_m // group
        qsl = md.query_start_loc_cpu
        dec_seqs: list[int] = []
        pre_seqs: list[int] = []
        pre_q0: list[int] = []
        for i in range(len(qsl) - 1):
            num_q = qsl[i + 1] - qsl[i]
            if num_q <= dec_q:
                dec_seqs.append(i)
            else:
                for q0 in range(0, num_q, pre_q):
                    pre_seqs.append(i)
                    pre_q0.append(q0)
        # the prefill table starts 16-byte aligned, like the decode one (one kernel variant)
        dec_len = -(-2 * len(dec_seqs) // 4) * 4
        flat = dec_seqs + [0] * (dec_len - len(dec_seqs)) + pre_seqs + pre_q0
        device = md.seq_lens.device
        work = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)
        launches = []
        if dec_seqs:
            splits = 1
            if not pre_seqs and self.num_kv_heads and md.max_query_len == 1:
                if self.num_sms is None:
                    self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                                    if device.type == "cuda" else 1)
                splits = num_kv_splits(len(dec_seqs), self.num_kv_heads, md.max_seq_len,
                                       self.num_sms)
            launches.append(_Launch(work[:2 * len(dec_seqs)], len(dec_seqs), dec_m, splits))
        if pre_seqs:
            launches.append(_Launch(work[dec_len:], len(pre_seqs), pre_m))
        return _TritonState(group, launches)

    # -- steps replayed from CUDA graphs with prompt rows (ar/prefill_graphs.py) -------------
    def _prefill_tokens(self) -> int:
        group = self.num_queries_per_kv
        return _block_m(PREFILL_BLOCK_M, group) // group

    def max_prefill_programs(self, num_tokens: int, num_seqs: int) -> int:
        """Prefill programs enough for any batch of up to num_tokens rows in num_seqs
        sequences: a program a full tile of queries, plus one partial tile a sequence."""
        return -(-num_tokens // self._prefill_tokens()) + num_seqs

    def static_prefill_state(self, work: Tensor) -> _TritonState:
        """The plan of a step captured in a CUDA graph: one launch of prefill programs (any
        mix of prompt chunks and decodes) over the static work table `work` ((2 * P,) int32:
        each program's sequence, then its first query), which `prefill_work` rewrites before
        every replay; P programs whatever the batch."""
        group = self.num_queries_per_kv
        return _TritonState(group, [_Launch(work, work.numel() // 2,
                                            _block_m(PREFILL_BLOCK_M, group))])

    def prefill_work(self, qsl: list[int], num_programs: int, pad_seq: int) -> list[int]:
        """The work table of `static_prefill_state` for a batch (query_start_loc qsl): the
        batch's programs, then programs of sequence pad_seq (no query, no context: they write
        nothing) up to num_programs."""
        step = self._prefill_tokens()
        seqs: list[int] = []
        firsts: list[int] = []
        for i in range(len(qsl) - 1):
            for q0 in range(0, qsl[i + 1] - qsl[i], step):
                seqs.append(i)
                firsts.append(q0)
        pad = num_programs - len(seqs)
        assert pad >= 0, f"{len(seqs)} programs for a table of {num_programs}"
        return seqs + [pad_seq] * pad + firsts + [0] * pad

    def rotate_and_attend(self, q: Tensor, k: Tensor, v: Tensor, rope_args: tuple,
                          k_cache: Tensor, v_cache: Tensor, md: AttentionMetadata,
                          scale: float) -> Tensor | None:
        """A split-K decode batch (one new token a sequence, too few sequences to fill the
        device) with plain rotary: q/k norm, rotary, the K/V store, attention and the merge
        of the slices in one kernel (triton_decode_attention.py) -> output (B, H, D). None
        where that does not apply (the caller takes the separate kernels). `Attention` calls
        it only where `fused.decode_attention_for` allows."""
        q_weight, k_weight, eps, cos, sin, positions, axis = rope_args
        state = md.backend_state
        if (axis is not None or not isinstance(state, _TritonState) or len(state.launches) != 1
                or state.launches[0].num_splits <= 1 or q.shape[0] != md.num_seqs
                or v.stride(1) != v.shape[2] or cos.shape[1] != q.shape[2]):
            return None
        return self._decode(q, k, v, q_weight, k_weight, eps, cos, sin, positions, k_cache,
                            v_cache, md.slot_mapping, md.seq_lens, md.block_tables, scale,
                            min(state.launches[0].num_splits, tda.MAX_SPLITS))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor | None,
                v_cache: Tensor | None, md: AttentionMetadata, scale: float,
                kv_stored: bool = False) -> Tensor:
        """kv_stored: the caller already wrote the new k/v into the caches (then k and v
        are only read for their shapes)."""
        if k_cache is None or v_cache is None:   # cache-less passes (memory profiling)
            return self._fallback.forward(q, k, v, None, None, md, scale)
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        state = md.backend_state
        if not isinstance(state, _TritonState) or state.group != group:
            self.num_queries_per_kv = group
            state = md.backend_state = self._plan(md, group)
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, md.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        assert q.stride(-1) == 1, "q rows must be contiguous in head_dim"
        ieee = q.dtype == torch.float32
        d_p2 = max(16, triton.next_power_of_2(head_dim))
        for launch in state.launches:
            block_m, splits = launch.block_m, launch.num_splits
            part = lse = out                     # unused unless split
            if splits > 1:
                part = torch.empty(q.shape[0], num_heads, splits, d_p2, dtype=torch.float32,
                                   device=q.device)
                lse = torch.empty(q.shape[0], num_heads, splits, dtype=torch.float32,
                                  device=q.device)
            _paged_attention_kernel[(launch.num_programs, num_kv_heads, splits)](
                q, k_cache, v_cache, out, part, lse, md.block_tables, md.seq_lens,
                md.query_start_loc, launch.work, launch.num_programs, scale * 1.4426950408889634,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
                k_cache.stride(1), k_cache.stride(2), md.block_tables.stride(0),
                part.stride(0), part.stride(1), lse.stride(0), lse.stride(1),
                G=group, D=head_dim, PAGE=k_cache.shape[1], BLOCK_M=block_m,
                BLOCK_Q=block_m // group, BLOCK_N=BLOCK_N, D_P2=d_p2, IEEE=ieee,
                NUM_SPLITS=splits, num_warps=4, num_stages=2, **pdl.launch_options(q, "attention"))
            if splits > 1:
                _combine_splits_kernel[(launch.num_programs, num_heads)](
                    part, lse, out, md.query_start_loc, launch.work, launch.num_programs,
                    part.stride(0), part.stride(1), lse.stride(0), lse.stride(1),
                    out.stride(0), out.stride(1), D=head_dim, D_P2=d_p2, NUM_SPLITS=splits,
                    **pdl.launch_options(q, "attention"))
        return out

