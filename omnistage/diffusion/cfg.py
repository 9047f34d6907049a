"""Classifier-free guidance branches, once for every pipeline: which rows of a step run the
unconditional (negative prompt) branch, which CFG rank runs which branch, and the usual mix.

A step's transformer rows are laid out branch after branch: every request's conditional
rows, then the unconditional rows of the requests that guide (true CFG; SD3 may add a third
branch, the skip-layer rows):

    rows:  | r0 img0 | r0 img1 | r1 img0 |  r0 img0 | r0 img1 |   (r1: no CFG)
           |<------ conditional, R ---->|  |<-- uncond., U -->|
           branch 0                        branch 1 (and any later branch)

One rank runs every branch that has rows in one call. CFG-parallel (two ranks,
diffusion/parallel.py): rank 0 runs branch 0, rank 1 every later branch, and both gather all
rows, so each rank combines the same predictions the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor

from omnistage.diffusion.parallel import gather_branches
from omnistage.diffusion.request import DiffusionRequest
from omnistage.layers.parallel import TPGroup

Branch = tuple[str, list[bool]]     # step-cache name, which requests have rows in it


@dataclass(frozen=True, slots=True)
class GuidedRows:
    """The guided requests of a batch: `spans` (first row, rows, scale) in row order, their
    rows `idx` (U,) and per request whether it guides."""
    spans: tuple[tuple[int, int, float], ...]
    idx: Tensor
    guided: tuple[bool, ...]

    @staticmethod
    def of(requests: list[DiffusionRequest], is_guided: Callable[[DiffusionRequest], bool],
           scale: Callable[[DiffusionRequest], float]) -> GuidedRows:
        spans, start, guided = [], 0, []
        for r in requests:
            n = r.latents.shape[0]
            guided.append(is_guided(r))
            if guided[-1]:
                spans.append((start, n, scale(r)))
            start += n
        idx = torch.cat([torch.arange(s, s + n) for s, n, _ in spans] or [torch.arange(0)])
        return GuidedRows(tuple(spans), idx, tuple(guided))

    def branches(self, suffix: str = "") -> list[Branch]:
        """The two branches' step-cache names and members (`suffix`: Wan2.2's expert)."""
        return [(f"cond{suffix}", [True] * len(self.guided)),
                (f"uncond{suffix}", list(self.guided))]

    def pairs(self, pred: Tensor, neg: Tensor) -> Iterator[tuple[slice, Tensor, float]]:
        """Per guided request: its rows in `pred` (R, ...), its rows of `neg` (U, ...), its
        scale (a float, as diffusers multiplies)."""
        k = 0
        for s, n, scale in self.spans:
            yield slice(s, s + n), neg[k:k + n], scale
            k += n

    def mix(self, pred: Tensor, neg: Tensor) -> Tensor:
        """diffusers' `uncond + scale * (cond - uncond)` on the guided rows of `pred`, in
        place; -> pred."""
        for rows, uncond, scale in self.pairs(pred, neg):
            pred[rows] = uncond + scale * (pred[rows] - uncond)
        return pred


def run_branches(ranks: TPGroup, sizes: list[int], run: Callable[[list[int]], Tensor],
                 like: Tensor) -> Tensor:
    """Every branch's output rows, branch after branch (`sizes[b]` rows in branch b).
    `run(branches)` is one model call over those branches' rows, in order. One rank: one call
    over the branches with rows. CFG-parallel: rank 0 calls branch 0, rank 1 the others, and
    the rows are gathered (`like[:0]`: a rank with no rows sends none)."""
    if ranks.world_size == 1:
        return run([b for b, n in enumerate(sizes) if n])
    mine = [b for b in ([0] if ranks.rank == 0 else range(1, len(sizes))) if sizes[b]]
    local = run(mine) if mine else like[:0]
    return gather_branches(local, [sizes[0], sum(sizes[1:])], ranks)
