"""Hidden-state rows kept with prefix-cached blocks, so that a request that emits hidden states
for a downstream stage (Qwen3-Omni's thinker feeding its talker) can still reuse a cached
prefix: the rows of the hit positions are sent from here instead of being recomputed.

    prefill of request A       rows of positions 0..P-1 go downstream, and a host copy of each
                               full prompt block's rows becomes that block's payload once the
                               block is hashed
    request B, same prefix     hits blocks whose payload is set (kv_cache.get_computed_blocks
                               stops at the first without); its first step computes only the
                               rest, and the hit rows are put before the rows it computed

Rows live on the host (one copy per hashed prompt block and emitted layer) and go when the
block's hash goes (eviction, reset). Only prompt blocks carry rows: an answer is rarely sent
back token for token, and its rows would cost host memory for nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from omnistage.ar.kv_cache import BlockManager
from omnistage.ar.sequence import Sequence

Rows = dict[int, Tensor]     # layer -> (n, hidden)


class HiddenRowCache:
    def __init__(self, block_manager: BlockManager) -> None:
        self.bm = block_manager
        self.prompt_rows: dict[str, list[Rows]] = {}   # request -> its prompt rows so far (host)

    def restore(self, seq: Sequence, rows: Rows) -> Rows:
        """A step's `rows` (after a prefix hit they start at the first computed position)
        with the hit positions' kept rows before them (sent once: the first step after)."""
        if not seq.cached_payloads:
            return rows
        payloads: list[Rows] = seq.cached_payloads    # type: ignore[assignment]
        seq.cached_payloads = []
        device = next(iter(rows.values())).device
        return {layer: torch.cat([*(p[layer].to(device) for p in payloads), r])
                for layer, r in rows.items()}

    def record(self, seq: Sequence, rows: Rows, start: int) -> None:
        """Keep the prompt rows among `rows` (positions from `start`) and hand each hashed,
        full prompt block its rows."""
        num_prompt = seq.num_prompt_tokens
        if not self.bm.is_cacheable(seq) or start >= num_prompt:
            self.prompt_rows.pop(seq.request_id, None)
            return
        kept = self.prompt_rows.setdefault(seq.request_id, [])
        have = sum(next(iter(r.values())).shape[0] for r in kept)
        if start != have:           # rows missing (a hit whose rows were never kept)
            self.prompt_rows.pop(seq.request_id, None)
            return
        n = min(num_prompt - start, next(iter(rows.values())).shape[0])
        kept.append({layer: r[:n].to("cpu", copy=True) for layer, r in rows.items()})
        self._attach(seq, kept, start + n)
        if start + n >= num_prompt:
            self.prompt_rows.pop(seq.request_id, None)

    def _attach(self, seq: Sequence, kept: list[Rows], num_rows: int) -> None:
        """Give each hashed block of the prompt's computed full blocks its rows (the hashed
        copy may be another request's: one that emits no hidden states, or that computed the
        same prefix at the same time)."""
        bs = self.bm.block_size
        whole: Rows | None = None
        for i, block in enumerate(self.bm.hashed_blocks(seq, min(num_rows,
                                                                 seq.num_prompt_tokens) // bs)):
            if block.payload is not None:
                continue
            if whole is None:
                whole = {layer: torch.cat([r[layer] for r in kept]) for layer in kept[0]}
            block.payload = {layer: t[i * bs:(i + 1) * bs].clone() for layer, t in whole.items()}

    def drop(self, request_id: str) -> None:
        self.prompt_rows.pop(request_id, None)
