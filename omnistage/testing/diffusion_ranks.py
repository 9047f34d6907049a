"""Rank bodies for the parallel diffusion tests (tests/diffusion/test_parallel.py), run on CPU
gloo ranks by `omnistage.testing.ranks.run_ranks`, and the tiny Qwen-Image folder they load."""

from __future__ import annotations

import torch

from omnistage.layers.groups import StageRanks
from omnistage.layers.sequence_parallel import SequenceSplit, sdpa


def sequence_attention(ranks: StageRanks, lengths: list[int], masked: bool) -> dict:
    """Joint attention over segments of `lengths` tokens (the first with a key mask when
    `masked`), split over the sequence-parallel ranks, against the whole sequence's SDPA:
    -> the largest difference and the reference's largest value."""
    g = torch.Generator().manual_seed(0)
    batch, heads, dim = 2, 4, 8
    q, k, v = ([torch.randn(batch, n, heads, dim, generator=g) for n in lengths]
               for _ in range(3))
    masks: list[torch.Tensor | None] = [None] * len(lengths)
    if masked:
        masks[0] = torch.rand(batch, lengths[0], generator=g) > 0.4
        masks[0][:, 0] = True
    whole = [torch.ones(batch, n, dtype=torch.bool) if m is None else m
             for m, n in zip(masks, lengths)]
    ref = sdpa(torch.cat(q, 1), torch.cat(k, 1), torch.cat(v, 1), torch.cat(whole, 1))

    split = SequenceSplit.split(lengths, masks)
    local = [torch.cat([split.local(t, i) for i, t in enumerate(ts)], 1) for ts in (q, k, v)]
    out = split.attend(*local)
    sizes = [seg[split.ranks.index] for seg in split.sizes]
    got = torch.cat([split.gather(part, i) for i, part in enumerate(out.split(sizes, 1))], 1)
    return {"diff": float((got - ref).abs().max()), "scale": float(ref.abs().max())}
