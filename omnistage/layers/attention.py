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
of its own sequence up to and including its own position (causal). Backends (their contract:
attention_backend.py): `TorchPagedAttention` (any device, the reference), `TritonPagedAttention` in triton_attention.py (CUDA kernels
over the paged cache, chosen by "auto" on CUDA, and safe inside CUDA graphs).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from omnistage.layers import fused
# AttentionMetadata and forward_context are re-exported: models and runners import them here
from omnistage.layers.attention_backend import (AttentionBackend, AttentionMetadata,  # noqa: F401
                                                TorchPagedAttention, forward_context,
                                                get_forward_context)
from omnistage.layers.rotary import fused_rope_args, norm_and_rotate

logger = logging.getLogger(__name__)


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
