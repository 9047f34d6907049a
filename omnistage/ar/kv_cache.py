"""Paged KV-cache bookkeeping with prefix caching: block ids, ref counts and hashes, no tensors.

Every block is in exactly one of three places:

    blocks[0 .. num_blocks)
      |
      +-- referenced (ref_count > 0) -- listed in one or more seq.block_table
      +-- free_block_ids  deque, ref_count 0, no hash          -> taken first by allocate()
      +-- evictable       LRU (OrderedDict), ref_count 0, hash -> oldest evicted when no free one
                          oldest ... newest                       (its hash leaves the table)

    hash_to_block_id: chained hash -> block id, for every hashed block (referenced or evictable)

A full block's hash chains the hash of the block before it, so equal hashes mean equal prefixes:

    seq.all_token_ids  | t0 .. t15 | t16 .. t31 | t32 .. t40 (partial) |
    block hash         | h0        | h1         | none yet             |
                         h0 = hash((None, t0..t15)),  h1 = hash((h0, t16..t31))

A lookup also compares the stored parent hash and token ids with the request's, so a collision of
one block's hash never yields a hit.

Prompts of embeddings are hashed by their `cache_ids` (Sequence.cache_id_at: multimodal
placeholders replaced by a digest of their media), or not at all. A sequence that emits hidden
states for a downstream stage hits only blocks that carry their rows (`Block.payload`, set by
the engine, ar/hidden_rows.py): those rows are sent in place of recomputing them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

from omnistage.ar.sequence import Sequence


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """Measured facts about the KV cache, returned by whoever sized it."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str            # e.g. "float32"
    bytes_per_block: int  # all layers, K and V

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def bytes_per_block(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                    dtype_size: int) -> int:
    """Bytes of one block: K and V of `block_size` positions in every layer."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_size


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None     # set only once the block is full and computed
    parent_hash: int | None = None    # hash of the block before it in the chain (None: first)
    token_ids: tuple[int, ...] = ()   # the block_size tokens (cache ids) of a hashed block
    payload: object | None = None     # what the engine keeps with a hashed block (hidden rows)

    def clear_hash(self) -> None:
        self.block_hash, self.parent_hash, self.token_ids = None, None, ()
        self.payload = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        assert num_blocks >= 1 and block_size >= 1, (num_blocks, block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # block id, oldest first
        self.hash_to_block_id: dict[int, int] = {}
        # request id -> (blocks of its table already hashed or skipped, chained hash of the last)
        self.hash_progress: dict[str, tuple[int, int | None]] = {}
        self.num_prefix_queries_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def is_cacheable(self, seq: Sequence) -> bool:
        """Embedding prompts only with ids that name their embeddings; streamed inputs never."""
        if not self.enable_prefix_caching or seq.stream is not None:
            return False
        return seq.prompt.embeds is None or seq.prompt.cache_ids is not None

    def get_computed_blocks(self, seq: Sequence) -> int:
        """Attach the longest cached prefix of full blocks to a newly admitted `seq`.

        Returns the number of hit tokens, capped so that at least the last token is still owed.
        """
        assert not seq.block_table, (seq.request_id, seq.block_table)
        assert seq.num_computed_tokens == 0, (seq.request_id, seq.num_computed_tokens)
        seq.num_cached_tokens = 0
        seq.cached_payloads = []
        if not self.is_cacheable(seq):
            return 0
        bs = self.block_size
        token_ids = seq.all_cache_ids
        parent_hash: int | None = None
        for i, block in enumerate(self._chain(token_ids, (len(token_ids) - 1) // bs)):
            if seq.wants_hidden and seq.num_hidden_emitted > 0:
                if (i + 1) * bs > seq.num_hidden_emitted:
                    break  # re-admitted (preempted): hit only rows it has sent already
            elif seq.wants_hidden:
                if block.payload is None:
                    break  # its hidden rows are not kept: the sequence must compute them
                seq.cached_payloads.append(block.payload)
            if block.ref_count == 0:
                del self.evictable[block.block_id]
            block.ref_count += 1
            seq.block_table.append(block.block_id)
            parent_hash = block.block_hash
        num_hit_tokens = len(seq.block_table) * bs
        self.hash_progress[seq.request_id] = (len(seq.block_table), parent_hash)
        seq.num_computed_tokens = seq.num_cached_tokens = num_hit_tokens
        self.num_prefix_queries_tokens += len(token_ids)
        self.num_prefix_hit_tokens += num_hit_tokens
        return num_hit_tokens

    def hashed_blocks(self, seq: Sequence, num_blocks: int) -> list[Block]:
        """The hashed blocks holding seq's first `num_blocks` full blocks of tokens (its own, or
        another request's copy where that one was hashed first), up to the first not hashed."""
        return list(self._chain(seq.all_cache_ids, num_blocks))

    def _chain(self, token_ids: list[int], num_blocks: int) -> Iterator[Block]:
        """The hashed blocks of the first `num_blocks` full blocks of `token_ids`, in order, up
        to the first that is not cached."""
        bs = self.block_size
        parent_hash: int | None = None
        for i in range(min(num_blocks, len(token_ids) // bs)):
            block_tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            block_hash = hash((parent_hash, block_tokens))
            block_id = self.hash_to_block_id.get(block_hash)
            if block_id is None:
                return
            block = self.blocks[block_id]
            if block.parent_hash != parent_hash or block.token_ids != block_tokens:
                return  # hash collision: same hash, different content
            yield block
            parent_hash = block_hash

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        num_tokens = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq.block_table to cover positions [0, num_computed_tokens + num_new_tokens)."""
        num_needed = self.num_blocks_needed(seq, num_new_tokens)
        assert num_needed <= self.num_free_blocks, (
            seq.request_id, num_needed, self.num_free_blocks)
        for _ in range(num_needed):
            if self.free_block_ids:
                block = self.blocks[self.free_block_ids.popleft()]
            else:
                block = self.blocks[self.evictable.popitem(last=False)[0]]
                assert self.hash_to_block_id.get(block.block_hash) == block.block_id, (
                    block.block_id, block.block_hash)
                del self.hash_to_block_id[block.block_hash]
                block.clear_hash()
            assert block.ref_count == 0 and block.block_hash is None, (
                block.block_id, block.ref_count, block.block_hash)
            block.ref_count = 1
            seq.block_table.append(block.block_id)

    def cache_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Hash the blocks that are full once K/V of positions [0, num_computed_tokens) exist."""
        if not self.is_cacheable(seq):
            return
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(seq.block_table))
        num_done, parent_hash = self.hash_progress.get(seq.request_id, (0, None))
        for i in range(num_done, num_full):
            block_tokens = tuple(seq.cache_id_at(j) for j in range(i * bs, (i + 1) * bs))
            block_hash = hash((parent_hash, block_tokens))
            block = self.blocks[seq.block_table[i]]
            assert block.ref_count > 0, (block.block_id, block.ref_count)
            # Another request computed the same prefix concurrently: leave this copy unhashed,
            # but keep chaining, so our later blocks still get their true hashes.
            if block.block_hash is None and block_hash not in self.hash_to_block_id:
                block.block_hash, block.parent_hash = block_hash, parent_hash
                block.token_ids = block_tokens
                self.hash_to_block_id[block_hash] = block.block_id
            parent_hash = block_hash
        if num_full > num_done:
            self.hash_progress[seq.request_id] = (num_full, parent_hash)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references, tail first: a sequence's tail is evicted before its head."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, (block.block_id, block.ref_count)
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_block_ids.append(block_id)
        seq.block_table.clear()
        self.hash_progress.pop(seq.request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (False) while any block is referenced."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block_id in self.evictable:
            self.blocks[block_id].clear_hash()
            self.free_block_ids.append(block_id)
        self.evictable.clear()
        self.hash_to_block_id.clear()
        return True
