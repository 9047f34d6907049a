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
of its own sequence up to and including its own position (causal). Backends: `TorchPagedAttention`
here (any device, the reference), `TritonPagedAttention` in triton_attention.py (CUDA kernels
over the paged cache, chosen by "auto" on CUDA, and safe inside CUDA graphs).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers import fused
from omnistage.layers.rotary import fused_rope_args, norm_and_rotate

logger = logging.getLogger(__name__)


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
    work or host-to-device copies."""

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


def triton_available() -> bool:
    """Whether the Triton kernels can run here (triton importable and a CUDA device)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_attention_backend(name: str, device: torch.device, block_size: int = 16,
                          num_queries_per_kv: int = 1, num_kv_heads: int | None = None
                          ) -> AttentionBackend:
    """auto: the Triton kernels on CUDA where triton is installed, else pure PyTorch.
    num_queries_per_kv (H / Hkv) and num_kv_heads help the Triton backend plan its launches."""
    if name == "triton" or (name == "auto" and device.type == "cuda" and triton_available()):
        if device.type != "cuda":
            raise ValueError(f"attention_backend='triton' needs a CUDA device, got {device}")
        from omnistage.layers.triton_attention import TritonPagedAttention

        return TritonPagedAttention(block_size, num_queries_per_kv, num_kv_heads)
    if name in ("auto", "torch"):
        return TorchPagedAttention(block_size)
    raise ValueError(f"attention_backend={name!r}: unknown (choose from auto, torch, triton)")


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
        # True: its module binds a cache of its own (a code predictor's per-frame one), and
        # the model runner's paged KV cache leaves it out
        self.private_cache = False
        self.backend: AttentionBackend = TorchPagedAttention()

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        md = get_forward_context()
        if md is None:
            raise RuntimeError("Attention called outside forward_context(...)")
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, md, self.scale)

    def rotate_and_attend(self, rotary: nn.Module, positions: Tensor, q: Tensor, k: Tensor,
                          v: Tensor, q_norm: nn.Module | None = None,
                          k_norm: nn.Module | None = None) -> Tensor:
        """Per-head q/k RMSNorm (if given), rotary, then attention. Where the fused kernels
        and a backend that reads K/V from the cache allow it, one kernel normalises, rotates
        and writes k and v into the cache (the backend's own K/V store is skipped)."""
        md = get_forward_context()
        if md is None:
            raise RuntimeError("Attention called outside forward_context(...)")
        global _fused_store_ok, _fused_decode_ok
        args = (fused_rope_args(rotary, positions, q, q_norm, k_norm)
                if _fused_store_ok and self.k_cache is not None
                and getattr(self.backend, "accepts_stored_kv", False) else None)
        fused_decode = (getattr(self.backend, "rotate_and_attend", None)
                        if _fused_decode_ok and fused.decode_attention_for(q) else None)
        if args is not None and fused_decode is not None:
            try:   # small decode batches: norm, rotary, store and attention in one kernel
                out = fused_decode(q, k, v, args, self.k_cache, self.v_cache, md, self.scale)
            except Exception:
                logger.warning("fused decode attention unavailable", exc_info=True)
                _fused_decode_ok = False
            else:
                if out is not None:
                    return out
        if args is not None:
            try:
                q_rot = fused.ops_for(q).qk_norm_rope_store(  # type: ignore[union-attr]
                    q, k, v, *args, self.k_cache, self.v_cache, md.slot_mapping)
            except Exception:   # the kernel does not build here: the separate kernels do
                logger.warning("fused q/k norm + rotary + K/V store unavailable", exc_info=True)
                _fused_store_ok = False
            else:
                return self.backend.forward(q_rot, k, v, self.k_cache, self.v_cache, md,
                                            self.scale, kv_stored=True)
        q, k = norm_and_rotate(rotary, positions, q, k, q_norm, k_norm)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, md, self.scale)


def paged_layers(model: nn.Module) -> list[Attention]:
    """The attention layers of `model` that the engine's paged KV cache serves (all but those
    with a private cache)."""
    return [m for m in model.modules() if isinstance(m, Attention) and not m.private_cache]


_fused_store_ok = True     # until the fused store kernel fails to build (see rotate_and_attend)
_fused_decode_ok = True    # the same for the fused decode attention kernel
