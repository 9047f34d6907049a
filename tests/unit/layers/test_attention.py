"""Paged attention vs plain causal attention over contiguous K/V, for mixed batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omnistage.layers.attention import TorchPagedAttention
from omnistage.testing.attention import mixed_batch_metadata


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: (S, H, D) queries at the last positions of a context k/v: (S_ctx, Hkv, D)."""
    n, ctx = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
    pos = torch.arange(ctx - n, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, -1), vv)


def test_mixed_prefill_chunks_and_decodes() -> None:
    torch.manual_seed(0)
    H, Hkv, D, bs, num_blocks = 4, 2, 8, 4, 64
    k_cache = torch.zeros(num_blocks, bs, Hkv, D)
    v_cache = torch.zeros_like(k_cache)
    # (tokens already cached, new tokens): a fresh prefill, a chunk on top of a cache,
    # and three decodes of different lengths
    shapes = [(0, 7), (9, 5), (12, 1), (3, 1), (30, 1)]
    perm = torch.randperm(num_blocks).tolist()  # blocks scattered over the pool
    tables, contexts, qs, slots, ks, vs = [], [], [], [], [], []
    for cached, new in shapes:
        total = cached + new
        table = [perm.pop() for _ in range(-(-total // bs))]
        k_all, v_all = torch.randn(total, Hkv, D), torch.randn(total, Hkv, D)
        for p in range(cached):  # already in the cache
            k_cache[table[p // bs], p % bs] = k_all[p]
            v_cache[table[p // bs], p % bs] = v_all[p]
        tables.append(table)
        contexts.append((k_all, v_all))
        qs.append(torch.randn(new, H, D))
        ks.append(k_all[cached:])
        vs.append(v_all[cached:])
        slots += [table[p // bs] * bs + p % bs for p in range(cached, total)]
    md = mixed_batch_metadata(shapes, tables, slots)
    out = TorchPagedAttention().forward(torch.cat(qs), torch.cat(ks), torch.cat(vs),
                                        k_cache, v_cache, md, D ** -0.5)
    for i, (q, (k_all, v_all)) in enumerate(zip(qs, contexts)):
        qsl = md.query_start_loc_cpu
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], reference(q, k_all, v_all, D ** -0.5),
                                   atol=1e-5, rtol=1e-5)
