"""Paged attention: the layer models use, the batch metadata it reads, and its backends.

A model calls `Attention(q, k, v)` on the flattened batch and never sees a block table: the
model runner publishes an `AttentionMetadata` through `forward_context(...)` around each forward
pass, and binds every layer's slice of the KV cache once at start-up.

Flattened batch of B sequences (prefill chunks and decodes mixed), T tokens in all:

    q/k/v rows:  | seq 0: 5 new tokens | seq 1: 1 | seq 2: 1 | seq 3: 7 |     (T = 14)
    query_start_loc = [0, 5, 6, 7, 14]
    seq_lens        = [context before + new] for each sequence
    slot_mapping[t] = block_id * block_size + offset where token t's K/V is written

A backend first writes the new K/V into the cache, then attends each query to every cached key
of its own sequence up to and including its own position (causal).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: Tensor            # (T,) int64, device
    query_start_loc: Tensor         # (B+1,) int32, device
    seq_lens: Tensor                # (B,) int32, device: tokens of context incl. the new ones
    block_tables: Tensor            # (B, max_blocks) int32, device, padded with 0
    query_start_loc_cpu: list[int]  # the same on the host, for loops and kernel launch sizes
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


# Thread-local: with the inproc backend several stages run forward passes in one process.
_LOCAL = threading.local()


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata | None) -> Iterator[None]:
    """Publish the batch metadata to every Attention layer for one forward pass."""
    prev = getattr(_LOCAL, "metadata", None)
    _LOCAL.metadata = metadata
    try:
        yield
    finally:
        _LOCAL.metadata = prev


def get_forward_context() -> AttentionMetadata | None:
    return getattr(_LOCAL, "metadata", None)


class AttentionBackend(Protocol):
    """What a kernel provides. `k_cache`/`v_cache`: (num_blocks, block_size, Hkv, D)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor | None,
                v_cache: Tensor | None, md: AttentionMetadata, scale: float) -> Tensor: ...


class TorchPagedAttention:
    """Pure-PyTorch paged attention: correct for any mix of prefill chunks and decodes, on any
    device. Decodes (one query each) go through one batched SDPA over their gathered, padded
    context; prefill chunks through one SDPA each. GPU kernels replace this for speed."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor | None,
                v_cache: Tensor | None, md: AttentionMetadata, scale: float) -> Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        if k_cache is not None:
            k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, k)
            v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, v)
        out = torch.empty_like(q)
        qsl = md.query_start_loc_cpu
        decodes = [i for i in range(md.num_seqs) if qsl[i + 1] - qsl[i] == 1]
        if k_cache is not None and len(decodes) > 1:
            self._decode_batch(q, k_cache, v_cache, md, scale, decodes, out)
            done = set(decodes)
        else:
            done = set()
        for i, seq_len in enumerate(md.seq_lens_cpu):
            if i in done:
                continue
            start, end = qsl[i], qsl[i + 1]
            num_q = end - start
            if k_cache is None:  # profiling run without a cache: the context is the new tokens
                assert num_q == seq_len, (num_q, seq_len)
                k_ctx, v_ctx = k[start:end], v[start:end]
            else:
                k_ctx, v_ctx = _gather(k_cache, v_cache, md.block_tables[i], seq_len)
            qi = q[start:end].transpose(0, 1).unsqueeze(0)         # (1, H, Lq, D)
            ki = k_ctx.transpose(0, 1).unsqueeze(0)                # (1, Hkv, S, D)
            vi = v_ctx.transpose(0, 1).unsqueeze(0)
            if num_q == 1:
                mask = None                                        # a decode sees everything
            else:
                q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale,
                                                enable_gqa=ki.shape[1] != qi.shape[1])
            out[start:end] = oi.squeeze(0).transpose(0, 1)
        return out

    @staticmethod
    def _decode_batch(q: Tensor, k_cache: Tensor, v_cache: Tensor, md: AttentionMetadata,
                      scale: float, rows: list[int], out: Tensor) -> None:
        block_size = k_cache.shape[1]
        lens = [md.seq_lens_cpu[i] for i in rows]
        num_blocks = -(-max(lens) // block_size)
        dev = q.device
        rows_t = torch.tensor(rows, device=dev)
        tables = md.block_tables[rows_t, :num_blocks].long()                  # (B, nb)
        kc = k_cache[tables].flatten(1, 2).transpose(1, 2)                    # (B, Hkv, S, D)
        vc = v_cache[tables].flatten(1, 2).transpose(1, 2)
        q_idx = md.query_start_loc[rows_t].long()
        qd = q[q_idx].unsqueeze(2)                                            # (B, H, 1, D)
        span = torch.arange(kc.shape[2], device=dev)
        mask = (span[None, :] < md.seq_lens[rows_t, None])[:, None, None, :]  # (B, 1, 1, S)
        od = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=mask, scale=scale,
                                            enable_gqa=kc.shape[1] != qd.shape[1])
        out[q_idx] = od.squeeze(2)


def _gather(k_cache: Tensor, v_cache: Tensor, table: Tensor, seq_len: int
            ) -> tuple[Tensor, Tensor]:
    """One sequence's cached K/V, (S, Hkv, D) each, from its block table."""
    num_blocks = -(-seq_len // k_cache.shape[1])
    blocks = table[:num_blocks].long()
    return k_cache[blocks].flatten(0, 1)[:seq_len], v_cache[blocks].flatten(0, 1)[:seq_len]


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name in ("auto", "torch"):
        return TorchPagedAttention()
    raise ValueError(f"attention_backend={name!r}: unknown (choose from auto, torch)")


class Attention(nn.Module):
    """The attention op of one decoder layer. q: (T, H, D), k/v: (T, Hkv, D) -> (T, H, D)."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int,
                 scale: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.k_cache: Tensor | None = None  # bound by the model runner
        self.v_cache: Tensor | None = None
        self.backend: AttentionBackend = TorchPagedAttention()

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        md = get_forward_context()
        if md is None:
            raise RuntimeError("Attention called outside forward_context(...)")
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, md, self.scale)
