"""BlockManager on CPU, no model: allocation, ref counts, prefix hits, hashing, eviction order."""

from __future__ import annotations

import pytest
import torch

from omnistage.ar import kv_cache
from omnistage.ar.kv_cache import BlockManager, KVCacheLayout, bytes_per_block
from omnistage.ar.sequence import Sequence
from omnistage.sampling_params import SamplingParams


def make_seq(request_id: str, token_ids: list[int], **params: object) -> Sequence:
    return Sequence(request_id=request_id, prompt_token_ids=list(token_ids),
                    sampling_params=SamplingParams(temperature=0, **params))


def admit(bm: BlockManager, seq: Sequence) -> int:
    """What the scheduler does for a waiting sequence: look up the prefix, allocate the rest."""
    num_hit_tokens = bm.get_computed_blocks(seq)
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    return num_hit_tokens


def prefill(bm: BlockManager, seq: Sequence) -> int:
    """Admit, compute the whole prompt in one step and register the full blocks."""
    num_hit_tokens = admit(bm, seq)
    bm.cache_blocks(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    return num_hit_tokens


def chain_hashes(token_ids: list[int], block_size: int) -> list[int]:
    hashes: list[int] = []
    parent: int | None = None
    for i in range(len(token_ids) // block_size):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)
    return hashes


PREFIX = list(range(1000, 1064))  # 64 tokens = 4 blocks of 16


def test_bytes_per_block_and_layout() -> None:
    assert bytes_per_block(16, 2, 4, 64, 4) == 2 * 2 * 16 * 4 * 64 * 4 == 65536
    layout = KVCacheLayout(num_blocks=10, block_size=16, num_layers=2, num_kv_heads=4,
                           head_dim=64, dtype="float32", bytes_per_block=65536)
    assert layout.total_bytes == 655360


def test_allocate_and_free_return_blocks() -> None:
    bm = BlockManager(num_blocks=10, block_size=16)
    seq = make_seq("r0", list(range(40)))
    assert bm.num_free_blocks == 10 and bm.usage == 0.0
    admit(bm, seq)
    assert seq.block_table == [0, 1, 2]
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 7
    assert bm.usage == pytest.approx(0.3)
    bm.free(seq)
    assert seq.block_table == []
    assert bm.num_free_blocks == 10 and bm.usage == 0.0
    assert all(b.ref_count == 0 for b in bm.blocks)
    bm.free(seq)  # empty table: no-op
    assert bm.num_free_blocks == 10
    # Never hashed, so the blocks went back to the free list (tail first), not the LRU.
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert len(bm.evictable) == 0


def test_allocate_grows_with_decode() -> None:
    bm = BlockManager(num_blocks=4, block_size=16)
    seq = make_seq("r0", list(range(16)))
    admit(bm, seq)
    assert seq.block_table == [0]
    seq.num_computed_tokens = 16
    seq.output_token_ids.append(7)
    assert bm.can_allocate(seq, 1)
    bm.allocate(seq, 1)  # position 16 starts block 1
    assert seq.block_table == [0, 1]
    seq.num_computed_tokens = 17
    bm.allocate(seq, 1)  # position 17 still fits in block 1
    assert seq.block_table == [0, 1]
    assert bm.num_free_blocks == 2


def test_shared_prefix_hits_and_ref_counts() -> None:
    bm = BlockManager(num_blocks=16, block_size=16)
    a = make_seq("a", PREFIX + list(range(8)))       # 72 tokens: 4 full blocks + 8
    assert prefill(bm, a) == 0
    assert a.num_cached_tokens == 0
    b = make_seq("b", PREFIX + [5, 6, 7, 8, 9])      # 69 tokens
    assert prefill(bm, b) == 64
    assert b.num_cached_tokens == 64
    assert b.block_table[:4] == a.block_table[:4]
    assert b.block_table[4] != a.block_table[4]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 2, 2, 1]
    assert bm.num_prefix_queries_tokens == 72 + 69
    assert bm.num_prefix_hit_tokens == 64
    assert bm.num_free_blocks == 16 - 6

    a_tail = a.block_table[4]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1, 1, 1]
    assert a_tail in bm.free_block_ids  # partial block, never hashed
    assert len(bm.evictable) == 0       # shared blocks are still referenced by b
    bm.free(b)
    assert list(bm.evictable) == [3, 2, 1, 0]  # hashed blocks stay hittable, tail first
    assert bm.num_free_blocks == 16

    c = make_seq("c", PREFIX + [1])
    assert bm.get_computed_blocks(c) == 64
    assert c.block_table == [0, 1, 2, 3]
    assert len(bm.evictable) == 0
    assert bm.num_free_blocks == 12


def test_whole_prompt_hit_is_capped_to_leave_one_token() -> None:
    bm = BlockManager(num_blocks=16, block_size=16)
    a = make_seq("a", PREFIX)
    prefill(bm, a)
    assert [bm.blocks[i].block_hash for i in a.block_table] == chain_hashes(PREFIX, 16)
    b = make_seq("b", PREFIX)
    assert bm.get_computed_blocks(b) == 48
    assert b.num_computed_tokens == 48 and b.num_cached_tokens == 48
    assert b.block_table == a.block_table[:3]
    bm.allocate(b, 16)  # the last block is recomputed into a fresh block
    assert len(b.block_table) == 4 and b.block_table[3] != a.block_table[3]
    c = make_seq("c", PREFIX + [0])
    assert bm.get_computed_blocks(c) == 64
    assert bm.num_prefix_hit_tokens == 48 + 64


def test_blocks_become_cacheable_only_when_full() -> None:
    bm = BlockManager(num_blocks=8, block_size=16)
    a = make_seq("a", list(range(40)))
    admit(bm, a)
    bm.cache_blocks(a, 15)
    assert [bm.blocks[i].block_hash for i in a.block_table] == [None, None, None]
    bm.cache_blocks(a, 20)
    bm.cache_blocks(a, 31)
    hashes = chain_hashes(list(range(48)), 16)
    assert [bm.blocks[i].block_hash for i in a.block_table] == [hashes[0], None, None]
    bm.cache_blocks(a, 40)
    assert [bm.blocks[i].block_hash for i in a.block_table] == [hashes[0], hashes[1], None]
    assert len(bm.hash_to_block_id) == 2
    # Decode fills the third block with output tokens: it is hashed once all 48 are computed.
    a.output_token_ids.extend(range(40, 48))
    bm.cache_blocks(a, 47)
    assert bm.blocks[a.block_table[2]].block_hash is None
    bm.cache_blocks(a, 48)
    assert [bm.blocks[i].block_hash for i in a.block_table] == hashes
    assert bm.blocks[a.block_table[2]].token_ids == tuple(range(32, 48))
    b = make_seq("b", list(range(48)) + [99])
    assert bm.get_computed_blocks(b) == 48


def test_chunked_prefill_hashes_equal_one_shot_prefill() -> None:
    tokens = list(range(500, 550))  # 50 tokens
    one_shot = BlockManager(num_blocks=8, block_size=16)
    a = make_seq("a", tokens)
    prefill(one_shot, a)
    chunked = BlockManager(num_blocks=8, block_size=16)
    b = make_seq("b", tokens)
    assert chunked.get_computed_blocks(b) == 0
    for end in (20, 40, 50):
        chunked.allocate(b, end - b.num_computed_tokens)
        chunked.cache_blocks(b, end)
        b.num_computed_tokens = end
    assert b.block_table == a.block_table == [0, 1, 2, 3]
    assert ([chunked.blocks[i].block_hash for i in b.block_table]
            == [one_shot.blocks[i].block_hash for i in a.block_table]
            == chain_hashes(tokens, 16) + [None])


def test_hash_collision_with_other_tokens_does_not_hit() -> None:
    bm = BlockManager(num_blocks=8, block_size=16)
    a = make_seq("a", list(range(33)))
    prefill(bm, a)
    a_head = a.block_table[0]
    bm.free(a)
    # Pretend b's first block hashes to the same value as a's first block.
    b_tokens = list(range(100, 133))
    bm.hash_to_block_id[chain_hashes(b_tokens, 16)[0]] = a_head
    b = make_seq("b", b_tokens)
    assert bm.get_computed_blocks(b) == 0
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert bm.num_prefix_hit_tokens == 0
    assert a_head in bm.evictable  # the colliding block was not taken


def test_colliding_hash_function_never_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every block hashes by its parent only: all first blocks collide, whatever their tokens.
    monkeypatch.setattr(kv_cache, "hash", lambda key: hash(key[0]), raising=False)
    bm = BlockManager(num_blocks=8, block_size=16)
    a = make_seq("a", list(range(33)))
    prefill(bm, a)
    assert len(bm.hash_to_block_id) == 1  # a's block 1 collides with its own block 0
    b = make_seq("b", list(range(100, 133)))
    assert prefill(bm, b) == 0
    assert [bm.blocks[i].block_hash for i in b.block_table] == [None, None, None]
    a2 = make_seq("a2", list(range(33)))
    assert bm.get_computed_blocks(a2) == 16  # the true content still hits
    assert a2.block_table == a.block_table[:1]


def test_hash_collision_with_other_parent_does_not_hit() -> None:
    bs = 16
    x, y, z = list(range(0, 16)), list(range(16, 32)), list(range(32, 48))
    bm = BlockManager(num_blocks=8, block_size=bs)
    a = make_seq("a", x + y + [1])  # a's block 1 holds y after x
    c = make_seq("c", z + [1])      # c's block 0 holds z
    prefill(bm, a)
    prefill(bm, c)
    # b = z + y: its block 1 has a's tokens y, but a different parent. Force its hash onto a's.
    bm.hash_to_block_id[chain_hashes(z + y, bs)[1]] = a.block_table[1]
    b = make_seq("b", z + y + [1])
    assert bm.get_computed_blocks(b) == 16
    assert b.block_table == c.block_table[:1]


def test_lru_evicts_oldest_and_tail_before_head() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq("a", list(range(9)))         # blocks 0 1 (hashed) 2 (partial)
    b = make_seq("b", list(range(100, 109)))  # blocks 3 4 (hashed) 5 (partial)
    prefill(bm, a)
    prefill(bm, b)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5])
    bm.free(a)
    bm.free(b)
    assert list(bm.free_block_ids) == [2, 5]
    assert list(bm.evictable) == [1, 0, 4, 3]  # oldest first; each sequence tail first
    c = make_seq("c", list(range(200, 217)))  # 17 tokens: 5 blocks
    assert bm.get_computed_blocks(c) == 0
    bm.allocate(c, 17)
    assert c.block_table == [2, 5, 1, 0, 4]   # free ones first, then LRU order
    assert list(bm.evictable) == [3]
    assert bm.hash_to_block_id == {chain_hashes(b.all_token_ids, 4)[0]: 3}
    assert all(bm.blocks[i].block_hash is None for i in (0, 1, 4))
    assert bm.get_computed_blocks(make_seq("a2", list(range(9)))) == 0
    b2 = make_seq("b2", list(range(100, 109)))
    assert bm.get_computed_blocks(b2) == 4    # b's head block survived its tail
    assert b2.block_table == [3]


def test_can_allocate_false_when_out_of_blocks() -> None:
    bm = BlockManager(num_blocks=4, block_size=16)
    big = make_seq("big", list(range(65)))
    assert bm.can_allocate(big, 64)
    assert not bm.can_allocate(big, 65)
    with pytest.raises(AssertionError):
        bm.allocate(big, 65)
    assert big.block_table == [] and bm.num_free_blocks == 4
    a = make_seq("a", list(range(48)))
    admit(bm, a)
    b = make_seq("b", list(range(100, 200)))
    assert bm.can_allocate(b, 16)
    assert not bm.can_allocate(b, 17)


def test_free_after_failed_allocation_undoes_hit() -> None:
    bm = BlockManager(num_blocks=5, block_size=16)
    a = make_seq("a", list(range(33)))
    prefill(bm, a)
    bm.free(a)
    assert list(bm.evictable) == [1, 0] and list(bm.free_block_ids) == [3, 4, 2]
    x = make_seq("x", list(range(500, 548)))
    admit(bm, x)
    assert x.block_table == [3, 4, 2]
    b = make_seq("b", list(range(32)) + list(range(300, 340)))  # 72 tokens: 5 blocks
    assert bm.get_computed_blocks(b) == 32
    assert b.block_table == [0, 1] and len(bm.evictable) == 0
    assert not bm.can_allocate(b, b.num_tokens - b.num_computed_tokens)
    bm.free(b)
    assert b.block_table == []
    assert bm.blocks[0].ref_count == bm.blocks[1].ref_count == 0
    assert list(bm.evictable) == [1, 0] and bm.num_free_blocks == 2
    assert len(bm.hash_to_block_id) == 2
    b.num_computed_tokens = 0  # the scheduler's part of the undo
    assert bm.get_computed_blocks(b) == 32


def test_embeds_without_cache_ids_never_hit_or_hash() -> None:
    bm = BlockManager(num_blocks=16, block_size=16)
    prefill(bm, make_seq("a", PREFIX + [1]))
    queries, hashed = bm.num_prefix_queries_tokens, len(bm.hash_to_block_id)
    e = make_seq("e", PREFIX + [1])
    e.prompt.embeds = torch.zeros(65, 8)
    assert prefill(bm, e) == 0
    assert e.num_cached_tokens == 0 and len(e.block_table) == 5
    assert all(bm.blocks[i].block_hash is None for i in e.block_table)
    assert bm.num_prefix_queries_tokens == queries
    assert len(bm.hash_to_block_id) == hashed == 4


def test_embeds_hit_and_hash_by_their_cache_ids() -> None:
    """A multimodal prompt's placeholders hash as their media digests: the same media hits,
    other media at the same placeholder positions does not."""
    bm = BlockManager(num_blocks=32, block_size=16)
    media = [-7] * 20                                 # one item's digest over its 20 placeholders
    ids = PREFIX[:16] + [5] * 20 + PREFIX[16:44]      # the placeholder id is 5

    def with_media(rid: str, digest: list[int]) -> Sequence:
        seq = make_seq(rid, ids + [1])
        seq.prompt.embeds = torch.zeros(len(ids) + 1, 8)
        seq.prompt.cache_ids = PREFIX[:16] + digest + PREFIX[16:44] + [1]
        return seq

    assert prefill(bm, with_media("a", media)) == 0
    assert prefill(bm, with_media("same", media)) == 64
    assert prefill(bm, with_media("other", [-8] * 20)) == 16      # up to the media only
    plain = make_seq("ids", ids + [1])                # the placeholder ids themselves never hit
    assert prefill(bm, plain) == 16


def test_hidden_consumers_hit_only_blocks_that_keep_their_rows() -> None:
    bm = BlockManager(num_blocks=32, block_size=16)
    a = make_seq("a", PREFIX + [1])
    prefill(bm, a)
    h = make_seq("h", PREFIX + [2], output_hidden_layers=(1,))
    assert admit(bm, h) == 0 and h.cached_payloads == []
    bm.free(h)
    h.num_computed_tokens = 0
    rows = [bm.blocks[i] for i in a.block_table[:4]]
    for k, block in enumerate(rows[:3]):              # the engine kept rows of three blocks
        block.payload = {1: torch.full((16, 4), float(k))}
    assert admit(bm, h) == 48
    assert [p[1][0, 0].item() for p in h.cached_payloads] == [0.0, 1.0, 2.0]
    assert bm.hashed_blocks(h, 4) == rows              # a's copies, whoever hashed them
    bm.free(h)
    again = make_seq("again", PREFIX + [2], output_hidden_layers=(1,))
    again.num_hidden_emitted = 20                     # preempted after sending 20 rows
    assert admit(bm, again) == 16 and again.cached_payloads == []
    bm.free(a)
    bm.free(again)
    for _ in range(bm.num_blocks):                    # evicting a block drops its rows
        bm.allocate(make_seq(f"x{_}", [0]), 1)
    assert all(b.payload is None for b in rows)


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(num_blocks=16, block_size=16, enable_prefix_caching=False)
    a = make_seq("a", PREFIX + [1])
    b = make_seq("b", PREFIX + [1])
    assert prefill(bm, a) == 0
    assert prefill(bm, b) == 0
    assert set(a.block_table).isdisjoint(b.block_table)
    assert bm.hash_to_block_id == {}
    bm.free(a)
    assert len(bm.evictable) == 0 and bm.num_free_blocks == 11
    assert bm.num_prefix_queries_tokens == bm.num_prefix_hit_tokens == 0


def test_concurrent_same_prefix_keeps_one_copy_hashed_and_chains_on() -> None:
    bm = BlockManager(num_blocks=16, block_size=16)
    a = make_seq("a", PREFIX[:32] + [1])
    b = make_seq("b", PREFIX[:32] + [2])
    assert admit(bm, a) == 0 and admit(bm, b) == 0  # both admitted before either is computed
    bm.cache_blocks(a, 33)
    bm.cache_blocks(b, 33)
    assert [bm.blocks[i].block_hash is not None for i in b.block_table] == [False, False, False]
    # b decodes to fill its third block; that block's hash chains through the unhashed copies.
    b.output_token_ids.extend(range(15))
    bm.cache_blocks(b, 48)
    b_tokens = b.all_token_ids
    assert bm.blocks[b.block_table[2]].block_hash == chain_hashes(b_tokens, 16)[2]
    c = make_seq("c", b_tokens + [3])
    assert bm.get_computed_blocks(c) == 48
    assert c.block_table == a.block_table[:2] + b.block_table[2:3]


def test_reset_prefix_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=16)
    a = make_seq("a", PREFIX + [1])
    prefill(bm, a)
    assert not bm.reset_prefix_cache()  # a still holds its blocks
    assert len(bm.hash_to_block_id) == 4
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.hash_to_block_id == {} and len(bm.evictable) == 0
    assert all(b.block_hash is None and b.token_ids == () for b in bm.blocks)
    assert bm.num_free_blocks == 8
    assert bm.get_computed_blocks(make_seq("b", PREFIX + [1])) == 0
