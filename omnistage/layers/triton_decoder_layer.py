"""One kernel per decoder layer for one-row decode steps (a single stream), CUDA; Triton's
interpreter on CPU. On by default where it measured faster than the per-op kernels
(`faster_here`: on no GPU since the per-op kernels launch early, pdl.py; the CPU tests run
it); `fused.set_layer_kernel(True)` forces it. The model decides where it applies (qwen2.py).

A one-row decode step reads every weight once and does little else: it is bound by memory
bandwidth only if the weights stream without gaps. Per-op kernels (seven a layer, ~200 a
token) each stream 4-12 MB in a few microseconds and cannot ramp to full bandwidth in that
time, and every launch leaves a gap (docs/benchmarks.md, "single stream"). Here a layer is one
launch of a persistent grid, one program per multiprocessor, that runs the layer's phases with
grid-wide barriers between them:

    P1  s = h + residual; RMSNorm(s) @ Wqkv^T (+ bias)              -> qkv         barrier
    P2  q/k RMSNorm + rotary, k/v into the paged cache, attention over the context, split
        into (KV head, slice) tasks on tensor-core tiles (the helpers of
        triton_decode_attention.py); the last task of a KV head merges its slices -> attn
                                                                                   barrier
    P3  attn @ Wo^T                                                  -> o           barrier
    P4  s2 = o + s; RMSNorm(s2) @ Wgate_up^T, silu(gate) * up        -> act         barrier
    P5  act @ Wdown^T                                                -> h'  (layer output h' + s2)

Weights are never written, so before each barrier a program fetches its first weight tile of
the next phase: the barrier's wait overlaps the fetch. The next layer's launch (programmatic
dependent launch, pdl.py) fetches its first q/k/v tile while this one runs.

A matmul phase splits its N outputs into one tile of ROWS rows a program (as many tiles as
programs where the rows allow), walking K in BLOCK_K chunks with the next chunk in flight; the
input vector (kilobytes, from L2) is rebuilt from the buffers by every program, with the norm's
inverse RMS from a first pass over it. Activations written in a phase are read with `.cg`
(L2, not the multiprocessor's L1, which is not coherent across programs).

Grid barrier: one int64 counter that only grows; a program adds 1 at each barrier (release) and
polls until it reaches base + b * programs (then an acquire). Every launch adds exactly
NUM_BARRIERS * programs, so `base` is the counter at the start rounded down to a multiple of
that (fewer than `programs` arrivals can precede a program's first read). The grid must be
resident at once: one program per multiprocessor, 8 warps, no large shared memory.
In the interpreter programs run one after another: a grid of one program (the tests).

Numerics are the per-op path's (triton_gemv.py, triton_ops.py, triton_attention.py): sums and
normalised values rounded to the weights' dtype where those round, products summed in float32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from omnistage.layers import pdl
from omnistage.layers.triton_decoder_layer_kernel import decoder_layer_kernel
from omnistage.utils.device import cuda_index

# Tuning, read at construction and launch (benchmarks/kernels/layer_kernel.py and
# benchmarks/ar_offline.py set it here).
# attention slices per KV head (16 on a 132-multiprocessor GPU with 8 KV heads): the H200's
# single stream made 1104 tok/s with 16 against 1027 with 8 (runs/kv_splits_h200_layer_kernel/)
MAX_SPLITS = 32
MAX_TILE = 16384        # weight elements a program holds per chunk (64 per thread at 8 warps)
NUM_WARPS = 8
MAX_REGISTERS: int | None = None   # per thread (None: the compiler's choice, 255 at 8 warps)


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's tensors, in the layout the kernel reads (all contiguous)."""
    input_norm: Tensor                 # (hidden,)
    qkv: Tensor                        # ((H + 2 Hkv) D, hidden)
    qkv_bias: Tensor | None
    q_norm: Tensor | None              # (D,) Qwen3
    k_norm: Tensor | None
    o: Tensor                          # (hidden, H D)
    o_bias: Tensor | None
    post_norm: Tensor                  # (hidden,)
    gate_up: Tensor                    # (2 I, hidden): gate rows, then up rows
    down: Tensor                       # (hidden, I)
    k_cache: Tensor                    # (num_blocks, block_size, Hkv, D)
    v_cache: Tensor


def _tiling(n: int, k: int, programs: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK_N, BLOCK_K) of a matmul phase: n outputs spread over the programs (a tile
    of ROWS rows each, at most one tile a program where n allows), K chunks to fit MAX_TILE."""
    rows = -(-n // programs)
    block_n = triton.next_power_of_2(rows)
    block_k = max(16, min(triton.next_power_of_2(k), MAX_TILE // block_n))
    return rows, block_n, block_k


def faster_here(x: Tensor) -> bool:
    """Whether one-row decodes on x's device run faster with the layer kernel than with the
    per-op kernels, as measured (Qwen3-0.6B's shapes). Nowhere on CUDA now: it was on an H200
    (layers 806 us a token against 952 for the per-op kernels then), until the per-op kernels
    with PDL's early launch (pdl.py) made an H200's single stream 1397 tok/s against its
    1100-1106 (benchmarks/results/runs/pdl_early_h200/); an H100, 838 against 674 us
    (runs/pdl_early_h100/). The interpreter (CPU tests): on."""
    return not x.is_cuda


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class DecoderStack:
    """The layers of a Qwen2/Qwen3-style decoder as one kernel launch each, for one-row
    decode steps. Scratch buffers are allocated once (graph-safe: a replay reuses them)."""

    def __init__(self, layers: list[LayerWeights], num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, qk_eps: float, scale: float, cos: Tensor,
                 sin: Tensor, programs: int | None = None, splits: int | None = None,
                 tile_programs: int | None = None) -> None:
        """programs: the grid (None: one per multiprocessor). Tests of the interpreter (a
        grid of one) set splits (attention slices per KV head) and tile_programs (tiles are
        cut as for that many programs; one program then takes them all)."""
        first = layers[0]
        dev, dt = first.qkv.device, first.qkv.dtype
        self.layers = layers
        self.hidden = first.qkv.shape[1]
        self.inter = first.down.shape[1]
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps, self.qk_eps, self.scale = eps, qk_eps, scale
        self.cos, self.sin = cos, sin
        if programs is None:
            programs = _num_sms(cuda_index(dev)) if dev.type == "cuda" else 1
        self.programs = programs
        self.skip = 0      # benchmarks/kernels/layer_kernel.py: phases left out (the SKIP)
        if splits is None:
            splits = 1
            while splits * 2 * num_kv_heads <= programs and splits * 2 <= MAX_SPLITS:
                splits *= 2
        assert splits & (splits - 1) == 0, splits
        self.splits = splits
        d_p2 = triton.next_power_of_2(head_dim)
        qkv_rows = (num_heads + 2 * num_kv_heads) * head_dim
        self.qkv_buf = torch.empty(qkv_rows, dtype=dt, device=dev)
        self.o_part = torch.empty(num_heads * splits * d_p2, dtype=torch.float32, device=dev)
        self.lse = torch.empty(num_heads * splits, dtype=torch.float32, device=dev)
        self.attn = torch.empty(num_heads * head_dim, dtype=dt, device=dev)
        self.o = torch.empty(self.hidden, dtype=dt, device=dev)
        self.act = torch.empty(self.inter, dtype=dt, device=dev)
        self.r_mid = torch.empty(1, self.hidden, dtype=dt, device=dev)
        self.residual = torch.empty(1, self.hidden, dtype=dt, device=dev)
        self.h = torch.empty(1, self.hidden, dtype=dt, device=dev)
        self.count = torch.zeros(1, dtype=torch.int64, device=dev)
        self.group_count = torch.zeros(num_kv_heads, dtype=torch.int64, device=dev)
        p = tile_programs or programs
        qkv_t = _tiling(qkv_rows, self.hidden, p)
        o_t = _tiling(self.hidden, num_heads * head_dim, p)
        gu_t = _tiling(self.inter, self.hidden, p)
        gu_t = (gu_t[0], gu_t[1], max(16, gu_t[2] // 2))        # two tiles (gate and up)
        d_t = _tiling(self.hidden, self.inter, p)
        self.consts = dict(
            HID=self.hidden, HQ=num_heads, HKV=num_kv_heads, D=head_dim, INTER=self.inter,
            PAGE=first.k_cache.shape[1], S=splits,
            ROWS_QKV=qkv_t[0], BN_QKV=qkv_t[1], BK_QKV=qkv_t[2],
            ROWS_O=o_t[0], BN_O=o_t[1], BK_O=o_t[2],
            ROWS_GU=gu_t[0], BN_GU=gu_t[1], BK_GU=gu_t[2],
            ROWS_D=d_t[0], BN_D=d_t[1], BK_D=d_t[2],
            QKV_BIAS=first.qkv_bias is not None, O_BIAS=first.o_bias is not None,
            QK_NORM=first.q_norm is not None)

    def __call__(self, h: Tensor, positions: Tensor, slot_mapping: Tensor, seq_lens: Tensor,
                 block_table: Tensor) -> tuple[Tensor, Tensor]:
        """h (1, hidden) through every layer -> (h', residual): the last layer's MLP output
        and residual (their sum is its output), in buffers the next call overwrites."""
        assert h.shape == (1, self.hidden) and h.is_contiguous(), h.shape
        scale = self.scale * 1.4426950408889634          # log2 domain
        opts = pdl.launch_options(h, "gemv")
        for i, lw in enumerate(self.layers):
            x = h if i == 0 else self.h
            cache = lw.k_cache
            decoder_layer_kernel[(self.programs,)](
                x, self.residual, self.r_mid, self.residual, self.h,
                lw.input_norm, lw.qkv, lw.qkv_bias if lw.qkv_bias is not None else lw.qkv,
                lw.q_norm if lw.q_norm is not None else lw.input_norm,
                lw.k_norm if lw.k_norm is not None else lw.input_norm,
                lw.o, lw.o_bias if lw.o_bias is not None else lw.o, lw.post_norm, lw.gate_up,
                lw.down, self.cos, self.sin, positions, slot_mapping, seq_lens, block_table,
                cache, lw.v_cache, self.qkv_buf, self.o_part, self.lse, self.attn, self.o,
                self.act, self.count, self.group_count,
                self.programs, self.cos.stride(0), cache.stride(0), self.eps, self.qk_eps,
                scale, FIRST=i == 0, IEEE=h.dtype == torch.float32, **self.consts, num_warps=NUM_WARPS, num_stages=1,
                **({"SKIP": self.skip} if self.skip else {}),
                **({"maxnreg": MAX_REGISTERS} if MAX_REGISTERS else {}), **opts)
        return self.h, self.residual
