"""How many KV blocks fit: measured once at start-up, returned as a `KVCacheLayout`.

CUDA: the stage may use `memory_fraction` of the device. From that we subtract what the weights
take and the activation peak of a profiling forward pass over a full step (`max_num_batched_tokens`
tokens, no cache); the rest is KV cache. CPU: a byte budget from the config.

Tensor parallelism: each rank caches its own key/value heads (the model's attention layers
say how many) and measures its own budget; the stage keeps the fewest blocks any rank found,
since rank 0's scheduler hands out block ids that every rank's cache must hold.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from omnistage.ar.kv_cache import KVCacheLayout, bytes_per_block
from omnistage.configs.schema import ARConfig, KVCacheConfig
from omnistage.layers.attention import AttentionMetadata, forward_context, paged_layers
from omnistage.layers.groups import stage_ranks
from omnistage.models.config import ModelConfig

logger = logging.getLogger(__name__)


def _layout(cfg: ModelConfig, kv: KVCacheConfig, dtype: torch.dtype, num_blocks: int,
            num_kv_heads: int) -> KVCacheLayout:
    per_block = bytes_per_block(kv.block_size, cfg.num_hidden_layers, num_kv_heads,
                                cfg.head_dim, dtype.itemsize)
    return KVCacheLayout(num_blocks=num_blocks, block_size=kv.block_size,
                         num_layers=cfg.num_hidden_layers, num_kv_heads=num_kv_heads,
                         head_dim=cfg.head_dim, dtype=str(dtype).removeprefix("torch."),
                         bytes_per_block=per_block)


def local_kv_heads(model: nn.Module, cfg: ModelConfig) -> int:
    """The key/value heads this rank caches: its attention layers' (all of them on one
    rank; a tensor-parallel rank's share, or one replicated head)."""
    heads = {m.num_kv_heads for m in paged_layers(model)}
    assert len(heads) <= 1, f"attention layers with different kv head counts: {heads}"
    return heads.pop() if heads else cfg.num_key_value_heads


def fewest_over_ranks(num_blocks: int, device: torch.device) -> int:
    """The smallest `num_blocks` any rank of the stage measured (every rank calls this)."""
    ranks = stage_ranks()
    if ranks.world_size == 1:
        return num_blocks
    t = torch.tensor([num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ranks.world.group)
    return int(t.item())


@torch.inference_mode()
def profile_peak_activation(model: nn.Module, num_tokens: int, max_model_len: int,
                            device: torch.device) -> int:
    """Run one cache-less forward over `num_tokens` dummy tokens (as sequences of at most
    max_model_len) and return the peak bytes allocated above the weights."""
    lens = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lens.append(num_tokens % max_model_len)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    md = AttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros((len(lens), 1), dtype=torch.int32, device=device),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens, max_query_len=max(lens),
        max_seq_len=max(lens))
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with forward_context(md):
        hidden, _ = model(input_ids, positions, None, ())
        model.compute_logits(hidden[-min(len(lens), 256):])
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def gpu_kv_blocks(memory_fraction: float, total: int, weights: int, peak: int, free_now: int,
                  bytes_per_block: int) -> int:
    """KV blocks that fit in `memory_fraction` of a GPU of `total` bytes after this stage's
    weights and activation peak, and in what is free now (other processes). RuntimeError with
    the numbers when not one block fits."""
    budget = memory_fraction * total
    available = min(budget - weights - peak, free_now - peak)
    num_blocks = max(0, int(available // bytes_per_block))
    gib = 2**30
    numbers = (f"memory_fraction {memory_fraction:g} of {total / gib:.1f} GiB = "
               f"{budget / gib:.1f} GiB; weights {weights / gib:.2f} GiB, activation peak "
               f"{peak / gib:.2f} GiB, free on the device now {free_now / gib:.1f} GiB")
    if num_blocks < 1:
        raise RuntimeError(
            f"no memory left for the KV cache ({numbers}; one block needs "
            f"{bytes_per_block / 2**20:.2f} MiB): raise memory_fraction (lowering that of "
            "stages sharing this GPU), lower max_num_batched_tokens, or put stages on other "
            "GPUs")
    logger.info("memory: %s; KV cache %d blocks (%.2f GiB)", numbers, num_blocks,
                num_blocks * bytes_per_block / gib)
    return num_blocks


def size_kv_cache(model: nn.Module, cfg: ModelConfig, config: ARConfig, device: torch.device,
                  dtype: torch.dtype, allocated_before: int = 0) -> tuple[KVCacheLayout, int]:
    """(the KV cache's layout, the engine's max_model_len): the configured length (at most the
    model's max_position_embeddings: above it is refused), lowered to what the cache holds,
    since a request alone must always fit or preemption could never make room for it.
    `allocated_before`: the device's bytes allocated before this stage loaded its model (under
    backend inproc, the stages built before it), not counted as its weights."""
    sched = config.scheduler
    limit = cfg.max_position_embeddings
    if sched.max_model_len is not None and sched.max_model_len > limit:
        raise ValueError(f"max_model_len {sched.max_model_len} exceeds the model's "
                         f"max_position_embeddings {limit}")
    max_model_len = sched.max_model_len or limit
    layout = determine_kv_layout(model, cfg, config.kv_cache, device, dtype,
                                 sched.max_num_batched_tokens, max_model_len, sched.max_num_seqs,
                                 config.memory_fraction, allocated_before)
    capacity = layout.num_blocks * layout.block_size
    if capacity < max_model_len:
        logger.warning("KV cache holds %d tokens: max_model_len lowered from %d",
                       capacity, max_model_len)
        max_model_len = capacity
    return layout, max_model_len


def determine_kv_layout(model: nn.Module, cfg: ModelConfig, kv: KVCacheConfig,
                        device: torch.device, dtype: torch.dtype, max_num_batched_tokens: int,
                        max_model_len: int, max_num_seqs: int, memory_fraction: float = 0.9,
                        allocated_before: int = 0) -> KVCacheLayout:
    num_kv_heads = local_kv_heads(model, cfg)
    one = _layout(cfg, kv, dtype, 1, num_kv_heads)
    if kv.num_blocks is not None:
        return _layout(cfg, kv, dtype, kv.num_blocks, num_kv_heads)
    if device.type == "cuda":
        weights = torch.cuda.memory_allocated(device) - allocated_before
        peak = profile_peak_activation(model, max_num_batched_tokens, max_model_len, device)
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        free_now = torch.cuda.mem_get_info(device)[0]
        num_blocks = gpu_kv_blocks(memory_fraction, total, weights, peak, free_now,
                                   one.bytes_per_block)
    else:
        # Host memory is not reserved up front the way device memory is: take no more than
        # every seat filled to max_model_len could use.
        enough = max_num_seqs * -(-max_model_len // kv.block_size)
        num_blocks = min(kv.cpu_kv_cache_bytes // one.bytes_per_block, enough)
    num_blocks = fewest_over_ranks(num_blocks, device)
    if num_blocks < 1:
        raise RuntimeError(
            f"no memory left for the KV cache (one block needs {one.bytes_per_block} bytes): "
            "raise memory_fraction / cpu_kv_cache_bytes or lower max_num_batched_tokens")
    return _layout(cfg, kv, dtype, num_blocks, num_kv_heads)
