"""Paged attention's contract with its backends: the batch metadata a backend reads, the
forward context that publishes it, the backend protocol, and the PyTorch reference backend.

attention.py (the layer models use, and the choice of backend) and triton_attention.py (the
CUDA kernels) both import this module and not each other, so the two stay free of an import
circle. The layout a backend serves is drawn in attention.py's docstring.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


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
    # What a backend derives once per step (index tensors, masks) for all layers to share;
    # filled by `AttentionBackend.prepare`.
    backend_state: object | None = None

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
    """What a kernel provides. `k_cache`/`v_cache`: (num_blocks, block_size, Hkv, D).
    `prepare` runs once per step, before the forward pass, so that per-layer calls do no host
    work or host-to-device copies. `supports_prefill_graphs`: steps with prompt rows can be
    captured in CUDA graphs too (ar/prefill_graphs.py plans them over a static work table)."""

    supports_prefill_graphs: bool

    def prepare(self, md: AttentionMetadata, has_cache: bool) -> None: ...

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor | None,
                v_cache: Tensor | None, md: AttentionMetadata, scale: float) -> Tensor: ...


@dataclass(slots=True)
class _TorchState:
    decode_q_idx: Tensor | None        # (Bd,) rows of the single-query sequences
    decode_tables: Tensor | None       # (Bd, nb) their block tables, to the longest context
    decode_mask: Tensor | None         # (Bd, 1, 1, nb * block_size) valid context positions
    # other sequences: (start, end, seq_len, blocks to gather or None for a fresh prefill,
    # causal mask offset by the cached context or None)
    chunks: list[tuple[int, int, int, Tensor | None, Tensor | None]]


class TorchPagedAttention:
    """Pure-PyTorch paged attention: correct for any mix of prefill chunks and decodes, on any
    device. Decodes (one query each) share one batched SDPA over their gathered, padded
    context; a fresh prefill is one causal SDPA on its own keys; a chunk on top of a cached
    context gathers that context. GPU kernels replace this for speed."""

    supports_prefill_graphs = False

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size

    def prepare(self, md: AttentionMetadata, has_cache: bool) -> None:
        bs, dev, qsl = self.block_size, md.slot_mapping.device, md.query_start_loc_cpu
        decodes, chunks = [], []
        for i, seq_len in enumerate(md.seq_lens_cpu):
            start, end = qsl[i], qsl[i + 1]
            num_q = end - start
            if has_cache and num_q == 1:
                decodes.append(i)
            elif not has_cache or num_q == seq_len:
                chunks.append((start, end, seq_len, None, None))
            else:
                blocks = md.block_tables[i, :-(-seq_len // bs)].long()
                q_pos = torch.arange(seq_len - num_q, seq_len, device=dev)
                mask = torch.arange(seq_len, device=dev)[None, :] <= q_pos[:, None]
                chunks.append((start, end, seq_len, blocks, mask))
        state = _TorchState(None, None, None, chunks)
        if decodes:
            rows = torch.tensor(decodes, device=dev)
            nb = -(-max(md.seq_lens_cpu[i] for i in decodes) // bs)
            state.decode_q_idx = md.query_start_loc[rows].long()
            state.decode_tables = md.block_tables[rows, :nb].long()
            span = torch.arange(nb * bs, device=dev)
            state.decode_mask = (span[None, :] < md.seq_lens[rows, None])[:, None, None, :]
        md.backend_state = state

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor | None,
                v_cache: Tensor | None, md: AttentionMetadata, scale: float) -> Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        if md.backend_state is None:  # called without the runner (tests, profiling)
            bs = k_cache.shape[1] if k_cache is not None else self.block_size
            TorchPagedAttention(bs).prepare(md, k_cache is not None)
        state: _TorchState = md.backend_state  # type: ignore[assignment]
        if k_cache is not None:
            k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, k)
            v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, v)
        gqa = q.shape[1] != num_kv_heads
        out = torch.empty_like(q)
        if state.decode_q_idx is not None:
            kc = k_cache[state.decode_tables].flatten(1, 2).transpose(1, 2)  # (B, Hkv, S, D)
            vc = v_cache[state.decode_tables].flatten(1, 2).transpose(1, 2)
            qd = q[state.decode_q_idx].unsqueeze(2)                         # (B, H, 1, D)
            od = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=state.decode_mask,
                                                scale=scale, enable_gqa=gqa)
            out[state.decode_q_idx] = od.squeeze(2)
        for start, end, seq_len, blocks, mask in state.chunks:
            qi = q[start:end].transpose(0, 1).unsqueeze(0)                   # (1, H, Lq, D)
            if blocks is None:  # a fresh prefill: its keys are the new ones
                ki = k[start:end].transpose(0, 1).unsqueeze(0)               # (1, Hkv, S, D)
                vi = v[start:end].transpose(0, 1).unsqueeze(0)
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=end - start > 1,
                                                    scale=scale, enable_gqa=gqa)
            else:
                ki = k_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1).unsqueeze(0)
                vi = v_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1).unsqueeze(0)
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale,
                                                    enable_gqa=gqa)
            out[start:end] = oi.squeeze(0).transpose(0, 1)
        return out
