"""diffusion/cfg.py, the one CFG-branch helper: which rows guide, the mix, and which CFG rank
runs which branch (the rows gathered back in branch order)."""

from __future__ import annotations

import pytest
import torch

from omnistage.diffusion import cfg
from omnistage.diffusion.cfg import GuidedRows, run_branches
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.request import DiffusionRequest
from omnistage.layers.parallel import TPGroup


def request(rid: str, rows: int, scale: float | None) -> DiffusionRequest:
    params = DiffusionParams(guidance_scale=scale)
    return DiffusionRequest(rid, "p", params, torch.zeros(rows, 2), torch.ones(3), {},
                            torch.Generator())


def test_guided_rows_and_mix() -> None:
    reqs = [request("a", 2, 3.0), request("b", 1, None), request("c", 1, 2.0)]
    guided = GuidedRows.of(reqs, lambda r: r.params.guidance_scale is not None,
                           lambda r: r.params.guidance_scale)
    assert guided.spans == ((0, 2, 3.0), (3, 1, 2.0)) and guided.guided == (True, False, True)
    assert guided.idx.tolist() == [0, 1, 3]
    assert guided.branches("1") == [("cond1", [True] * 3), ("uncond1", [True, False, True])]
    pred, neg = torch.arange(8.0).view(4, 2), torch.ones(3, 2)
    want = pred.clone()
    want[[0, 1]] = 1 + 3.0 * (pred[[0, 1]] - 1)
    want[3] = 1 + 2.0 * (pred[3] - 1)
    assert torch.equal(guided.mix(pred, neg), want)
    none = GuidedRows.of(reqs, lambda r: False, lambda r: 1.0)
    assert none.idx.tolist() == [] and none.branches()[1] == ("uncond", [False] * 3)


def test_one_rank_runs_the_branches_with_rows_in_one_call() -> None:
    calls: list[list[int]] = []

    def run(chosen: list[int]) -> torch.Tensor:
        calls.append(chosen)
        return torch.zeros(sum([3, 0, 2][b] for b in chosen), 1)

    out = run_branches(TPGroup(0, 1, None), [3, 0, 2], run, torch.zeros(1, 1))
    assert calls == [[0, 2]] and out.shape == (5, 1)


@pytest.mark.parametrize("rank", [0, 1])
def test_cfg_parallel_rank_0_runs_branch_0_and_rank_1_the_rest(
        rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gathered: list[tuple[int, list[int]]] = []

    def gather(local: torch.Tensor, sizes: list[int], group: TPGroup) -> torch.Tensor:
        gathered.append((local.shape[0], sizes))
        return torch.zeros(sum(sizes), 1)

    monkeypatch.setattr(cfg, "gather_branches", gather)
    calls: list[list[int]] = []

    def run(chosen: list[int]) -> torch.Tensor:
        calls.append(chosen)
        return torch.zeros(sum([3, 1, 2][b] for b in chosen), 1)

    out = run_branches(TPGroup(rank, 2, None), [3, 1, 2], run, torch.zeros(4, 1))
    assert calls == ([[0]] if rank == 0 else [[1, 2]])
    assert gathered == [(3, [3, 3])] and out.shape == (6, 1)      # 3 rows on either rank
    calls.clear()
    run_branches(TPGroup(rank, 2, None), [3, 0], run, torch.zeros(4, 1))   # nothing guides
    assert calls == ([[0]] if rank == 0 else [])             # rank 1 sends no rows
    assert gathered[-1] == ((3, [3, 0]) if rank == 0 else (0, [3, 0]))
