"""The configuration tree: frozen dataclasses, built once and passed down by constructor.

Facts measured at start-up (how many KV blocks fit) are *not* written here: they come back in
their own result objects (`omnistage.ar.kv_cache.KVCacheLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # CUDA: share of device memory for weights + KV cache + activations of this stage.
    memory_fraction: float = 0.9
    # CPU: bytes for the KV cache (no device memory to measure).
    cpu_kv_cache_bytes: int = 1 << 30
    # Force an exact number of blocks (tests, debugging); None = from the memory budget.
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"kv_cache.block_size={self.block_size}: must be a power of two")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"kv_cache.memory_fraction={self.memory_fraction}: must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"kv_cache.num_blocks={self.num_blocks}: must be >= 1")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"scheduler.max_num_seqs={self.max_num_seqs}: must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"scheduler.max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1")


@dataclass(frozen=True, slots=True)
class ARConfig:
    """Everything an autoregressive stage engine needs besides the checkpoint itself."""

    model: str = ""
    component: str | None = None  # sub-model of a multi-part checkpoint (issue 3+)
    device: Literal["auto", "cpu", "cuda"] | str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 0
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: Literal["auto", "torch"] = "auto"
