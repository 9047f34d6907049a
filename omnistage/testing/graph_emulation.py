"""Decode CUDA graphs emulated on CPU, for tests of what surrounds them (tensor-parallel
plans, async scheduling). With `graph_capture.capture_graph` replaced by `rerun_capture` (the
caller's to patch: a capture runs the forward pass twice, warm-up and "recording", as on
CUDA; a replay reruns it on the static buffers), `emulate_decode_graphs(engine)` gives an AR
engine `DecodeGraphs` and an attention backend whose decode batches read only device tensors,
as a replayed graph must (lengths, slots and tables from the buffers, no host lists).
tests/golden/ar/test_cuda_graphs.py uses the same capture with Triton's kernels in its interpreter.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from omnistage.ar.cuda_graphs import DecodeGraphs
from omnistage.layers.attention import AttentionMetadata, TorchPagedAttention


def _copy_into(dst: object, src: object) -> None:
    if isinstance(dst, Tensor):
        dst.copy_(src)  # type: ignore[arg-type]
    elif isinstance(dst, dict):
        for key in dst:
            _copy_into(dst[key], src[key])  # type: ignore[index]
    else:
        for d, s in zip(dst, src):  # type: ignore[call-overload]
            _copy_into(d, s)


class RerunGraph:
    """A captured graph's stand-in: replay reruns fn into the outputs of the capture."""

    def __init__(self, fn: Callable[[], object], out: object) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        _copy_into(self.out, self.fn())

    def pool(self) -> None:
        return None


def rerun_capture(fn: Callable[[], object], pool: object) -> tuple[RerunGraph, object]:
    """`graph_capture.capture_graph` on CPU: the warm-up, then the run CUDA would record."""
    fn()
    out = fn()
    return RerunGraph(fn, out), out


class DeviceOnlyAttention(TorchPagedAttention):
    """Decode-only batches (one query a sequence) from device tensors alone, over every
    column of the block tables, masked by `seq_lens`; slot -1 writes nothing. Other batches
    as `TorchPagedAttention`."""

    supports_cuda_graphs = True

    def prepare(self, md: AttentionMetadata, has_cache: bool) -> None:
        if md.max_query_len != 1:
            super().prepare(md, has_cache)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor | None,
                v_cache: Tensor | None, md: AttentionMetadata, scale: float) -> Tensor:
        if md.max_query_len != 1 or k_cache is None or v_cache is None:
            return super().forward(q, k, v, k_cache, v_cache, md, scale)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        write = md.slot_mapping >= 0
        k_cache.view(-1, num_kv_heads, head_dim)[md.slot_mapping[write]] = k[write]
        v_cache.view(-1, num_kv_heads, head_dim)[md.slot_mapping[write]] = v[write]
        tables = md.block_tables.long()                                     # (B, W)
        keys = k_cache[tables].flatten(1, 2).transpose(1, 2)                # (B, Hkv, S, D)
        values = v_cache[tables].flatten(1, 2).transpose(1, 2)
        span = torch.arange(keys.shape[2], device=q.device)
        mask = span[None, :] < md.seq_lens[:, None].clamp_min(1)            # padding: pos 0
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values,
                                             attn_mask=mask[:, None, None, :], scale=scale,
                                             enable_gqa=q.shape[1] != num_kv_heads)
        return out.squeeze(2)                                               # (B, H, D)


def emulate_decode_graphs(engine: object, max_blocks: int = 32) -> None:
    """Give an AR engine (on CPU) emulated decode graphs and the device-only attention;
    graphs are captured on first use. Every rank of a stage calls it alike."""
    runner = engine.runner  # type: ignore[attr-defined]
    runner.backend = DeviceOnlyAttention(runner.layout.block_size)
    for layer in runner.attn_layers:
        layer.backend = runner.backend
    runner.graphs = DecodeGraphs(runner.model, runner.backend, runner.layout.block_size,
                                 engine.config.scheduler.max_num_seqs,  # type: ignore[attr-defined]
                                 max_blocks, runner.device, runner.model.uses_mrope)
