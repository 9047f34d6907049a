"""The Triton paged-attention kernels against a float64 reference and the PyTorch backend, on
random mixed batches (fresh prefills, chunks on a cached prefix, decodes, GQA, pages scattered
over the pool). On a GPU the kernels are compiled; without one they run in Triton's interpreter
on CPU tensors (tiny shapes), in a child process: TRITON_INTERPRET must be set before `import
torch`, which imports triton (tests/gpu/test_ar_cuda.py adds bf16 and long contexts)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from omnistage.layers.attention import TorchPagedAttention  # noqa: E402
from omnistage.layers.triton_attention import (TritonPagedAttention, num_kv_splits,  # noqa: E402
                                               store_kv)
from omnistage.testing.attention import mixed_batch_metadata  # noqa: E402
from omnistage.testing.interpreter import (INTERPRETING, patch_interpreter,  # noqa: E402
                                           run_in_interpreter)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS_HERE = torch.cuda.is_available() or INTERPRETING
kernel_test = pytest.mark.skipif(not KERNELS_HERE, reason="runs in the interpreter child")

if DEVICE.type == "cpu" and KERNELS_HERE:
    patch_interpreter()


@pytest.mark.skipif(KERNELS_HERE, reason="the kernels run in this process")
def test_kernels_in_triton_interpreter() -> None:
    """Re-run this file with TRITON_INTERPRET=1 in a child process (CPU only)."""
    run_in_interpreter(__file__)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of q (n, H, D), the last n positions of k/v (ctx, Hkv, D)."""
    q, k, v = q.double(), k.double(), v.double()
    n, ctx = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
    pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(ctx, device=q.device)[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vv)


def make_batch(shapes: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, seed: int, device: torch.device = DEVICE):
    """Random batch of sequences (tokens cached, new tokens): caches holding the cached part,
    the new q/k/v rows, metadata, and each sequence's full (k, v) for the reference."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(k_cache.shape, generator=gen)   # garbage outside the pages in use
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, contexts, qs, ks, vs, slots = [], [], [], [], [], []
    for cached, new in shapes:
        total = cached + new
        table = [perm.pop() for _ in range(-(-total // block_size))]
        k_all = torch.randn(total, num_kv_heads, head_dim, generator=gen)
        v_all = torch.randn(total, num_kv_heads, head_dim, generator=gen)
        for p in range(cached):
            k_cache[table[p // block_size], p % block_size] = k_all[p]
            v_cache[table[p // block_size], p % block_size] = v_all[p]
        tables.append(table)
        contexts.append((k_all.to(dtype), v_all.to(dtype)))
        qs.append(torch.randn(new, num_heads, head_dim, generator=gen).to(dtype))
        ks.append(k_all[cached:])
        vs.append(v_all[cached:])
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(cached, total)]
    md = mixed_batch_metadata(shapes, tables, slots, device, pad=7)
    to = dict(device=device, dtype=dtype)
    return (torch.cat(qs).to(**to), torch.cat(ks).to(**to), torch.cat(vs).to(**to),
            k_cache.to(**to), v_cache.to(**to), md, qs, contexts)


@kernel_test
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (4, 2, 16, 4),     # GQA 2, pages smaller than a key tile
    (6, 2, 8, 16),     # G = 3 (not a power of two), head_dim below the 16-wide dot
    (8, 1, 32, 32),    # G = 8 (MQA)
])
def test_mixed_batch_matches_float64_reference(num_heads: int, num_kv_heads: int,
                                               head_dim: int, block_size: int) -> None:
    # a fresh prefill longer than one prefill tile, a chunk on a cached prefix, decodes, and a
    # short multi-token chunk that fits a decode program
    shapes = [(0, 37), (21, 9), (12, 1), (3, 1), (70, 1), (5, 3)]
    q, k, v, k_cache, v_cache, md, qs, contexts = make_batch(
        shapes, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed=1)
    scale = head_dim ** -0.5
    backend = TritonPagedAttention(block_size)
    backend.prepare(md, has_cache=True)
    out = backend.forward(q, k, v, k_cache, v_cache, md, scale)
    for i, (qi, (k_all, v_all)) in enumerate(zip(qs, contexts)):
        got = out[md.query_start_loc_cpu[i]:md.query_start_loc_cpu[i + 1]]
        ref = reference(qi.to(DEVICE), k_all.to(DEVICE), v_all.to(DEVICE), scale)
        torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=2e-5)
    # and it wrote the new K/V where the torch backend would
    q2, k2, v2, kc2, vc2, md2, _, _ = make_batch(
        shapes, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed=1)
    ref_out = TorchPagedAttention(block_size).forward(q2, k2, v2, kc2, vc2, md2, scale)
    torch.testing.assert_close(k_cache, kc2, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, vc2, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)


@kernel_test
def test_padding_rows_write_nothing_and_return_zeros() -> None:
    """CUDA-graph padding: slot -1 and seq_len 0 rows leave the cache alone."""
    shapes = [(9, 1), (30, 1)]
    q, k, v, k_cache, v_cache, md, qs, contexts = make_batch(
        shapes, 4, 2, 16, 8, torch.float32, seed=2)
    pad_q = torch.randn(2, 4, 16, device=DEVICE)
    pad_kv = torch.randn(2, 2, 16, device=DEVICE)
    md.slot_mapping = torch.cat([md.slot_mapping, torch.full((2,), -1, device=DEVICE)])
    md.query_start_loc = torch.arange(5, dtype=torch.int32, device=DEVICE)
    md.seq_lens = torch.cat([md.seq_lens, torch.zeros(2, dtype=torch.int32, device=DEVICE)])
    md.block_tables = torch.cat([md.block_tables, torch.zeros_like(md.block_tables[:2])])
    md.query_start_loc_cpu, md.seq_lens_cpu = [0, 1, 2, 3, 4], md.seq_lens_cpu + [1, 1]
    before_k, before_v = k_cache.clone(), v_cache.clone()
    backend = TritonPagedAttention(8, num_queries_per_kv=2)
    backend.prepare(md, has_cache=True)
    out = backend.forward(torch.cat([q, pad_q]), torch.cat([k, pad_kv]), torch.cat([v, pad_kv]),
                          k_cache, v_cache, md, 0.25)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    changed = (k_cache != before_k).any(-1).any(-1).nonzero().tolist()
    assert sorted(tuple(c) for c in changed) == sorted(
        (md.slot_mapping[i].item() // 8, md.slot_mapping[i].item() % 8) for i in range(2))
    for i, (qi, (k_all, v_all)) in enumerate(zip(qs, contexts)):
        torch.testing.assert_close(out[i:i + 1].double(), reference(
            qi.to(DEVICE), k_all.to(DEVICE), v_all.to(DEVICE), 0.25), atol=2e-5, rtol=2e-5)
    assert torch.equal(v_cache != before_v, k_cache != before_k)


@kernel_test
def test_store_kv_skips_negative_slots() -> None:
    k_cache = torch.zeros(4, 4, 2, 8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(3, 2, 8, device=DEVICE)
    v = torch.randn(3, 2, 8, device=DEVICE)
    store_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 14], device=DEVICE))
    flat_k, flat_v = k_cache.view(16, 2, 8), v_cache.view(16, 2, 8)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[14], k[2])
    assert torch.equal(flat_v[5], v[0]) and torch.equal(flat_v[14], v[2])
    assert int((flat_k != 0).any(-1).any(-1).sum()) == 2


@kernel_test
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 2)])
def test_split_k_decode_matches_reference(num_heads: int, num_kv_heads: int) -> None:
    """Small pure-decode batches split each context over several programs and combine them;
    a split can be empty (short contexts) and a padding row has no context at all."""
    shapes = [(300, 1), (129, 1), (4, 1), (64, 1)]
    q, k, v, k_cache, v_cache, md, qs, contexts = make_batch(
        shapes, num_heads, num_kv_heads, 16, 16, torch.float32, seed=3)
    # and a padding row, as a CUDA graph's bucket has them: no slot, no context
    md.slot_mapping = torch.cat([md.slot_mapping, torch.full((1,), -1, device=DEVICE)])
    md.query_start_loc = torch.arange(6, dtype=torch.int32, device=DEVICE)
    md.seq_lens = torch.cat([md.seq_lens, torch.zeros(1, dtype=torch.int32, device=DEVICE)])
    md.block_tables = torch.cat([md.block_tables, md.block_tables[:1]])
    md.query_start_loc_cpu, md.seq_lens_cpu = [0, 1, 2, 3, 4, 5], md.seq_lens_cpu + [1]
    q = torch.cat([q, torch.randn(1, num_heads, 16, device=DEVICE)])
    k = torch.cat([k, torch.randn(1, num_kv_heads, 16, device=DEVICE)])
    v = torch.cat([v, torch.randn(1, num_kv_heads, 16, device=DEVICE)])
    backend = TritonPagedAttention(16, num_heads // num_kv_heads, num_kv_heads, num_sms=64)
    backend.prepare(md, has_cache=True)
    (launch,) = md.backend_state.launches
    assert launch.num_splits == num_kv_splits(5, num_kv_heads, 301, 64) > 1
    out = backend.forward(q, k, v, k_cache, v_cache, md, 0.25)
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    for i, (qi, (k_all, v_all)) in enumerate(zip(qs, contexts)):
        ref = reference(qi.to(DEVICE), k_all.to(DEVICE), v_all.to(DEVICE), 0.25)
        torch.testing.assert_close(out[i:i + 1].double(), ref, atol=2e-5, rtol=2e-5)


def test_num_kv_splits() -> None:
    assert num_kv_splits(1, 8, 4096, 132) == 8         # one sequence: MAX_SPLITS
    assert num_kv_splits(4, 8, 4096, 132) == 4
    assert num_kv_splits(16, 8, 4096, 132) == 1        # already 128 programs
    assert num_kv_splits(1, 8, 100, 132) == 2          # no more splits than key tiles
    assert num_kv_splits(1, 8, 10, 132) == 1
