"""Batch metadata for attention tests: mixed batches of prefill chunks and decodes."""

from __future__ import annotations

import torch

from omnistage.layers.attention import AttentionMetadata


def mixed_batch_metadata(shapes: list[tuple[int, int]], tables: list[list[int]],
                         slots: list[int], device: torch.device | str = "cpu",
                         pad: int = 0) -> AttentionMetadata:
    """shapes: (tokens cached before, new tokens) per sequence; tables: their block tables,
    padded with `pad` to the longest; slots: where the new tokens' K/V go, in batch order."""
    qsl = [0]
    for _, new in shapes:
        qsl.append(qsl[-1] + new)
    lens = [c + n for c, n in shapes]
    width = max(map(len, tables))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [pad] * (width - len(t)) for t in tables],
                                  dtype=torch.int32, device=device),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens, max_query_len=max(n for _, n in shapes),
        max_seq_len=max(lens))
