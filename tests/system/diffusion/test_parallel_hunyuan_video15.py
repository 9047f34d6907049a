"""HunyuanVideo-1.5 over two CPU ranks (gloo) against one rank: Ulysses is its canonical
multi-GPU form. One forward of the tiny transformer (30 video tokens and two context lengths,
both split over the ranks; image tokens) under Ulysses 2, ring 2 and TP 2; and the pipeline
(three requests batched at different steps, CFG and not, one step-cached) under Ulysses 2 and
CFG-parallel 2: every rank ends with the one-rank latents."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.configs.schema import ParallelSizes
from omnistage.layers.groups import StageRanks
from omnistage.testing.ranks import run_ranks
from tests.helpers.hunyuan_video15 import (RANK_CASES, build_tiny_t2v, ranks_forward,
                                           ranks_run, save_transformer)

pytest.importorskip("diffusers")

TARGET = "tests.helpers.hunyuan_video15"
LAYOUTS = {"ulysses2": ParallelSizes(ulysses=2), "ring2": ParallelSizes(ring=2),
           "tp2": ParallelSizes(tp=2), "cfg2": ParallelSizes(cfg=2)}


@pytest.mark.parametrize("layout", ["ulysses2", "ring2", "tp2"])
def test_transformer_matches_one_rank(tmp_path_factory: pytest.TempPathFactory, layout: str,
                                      tmp_path: Path) -> None:
    folder = str(save_transformer(tmp_path_factory.mktemp("hv15"), task_type="i2v"))
    reference = torch.tensor(ranks_forward(StageRanks.single(), folder))
    assert reference.abs().max() > 1.0
    for result in run_ranks(f"{TARGET}:ranks_forward", LAYOUTS[layout], {"folder": folder},
                            tmp_path):
        assert (torch.tensor(result) - reference).abs().max() < 1e-5 * reference.abs().max()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    folder = tmp_path_factory.mktemp("hv15_t2v")
    build_tiny_t2v(folder)
    return str(folder), ranks_run(StageRanks.single(), str(folder), RANK_CASES)


@pytest.mark.parametrize("layout", ["ulysses2", "cfg2"])
def test_latents_match_one_rank(pipeline: tuple[str, dict], layout: str, tmp_path: Path
                                ) -> None:
    folder, reference = pipeline
    assert sum(reference["skipped"]["b"].values()) > 0          # the cache is exercised
    results = run_ranks(f"{TARGET}:ranks_run", LAYOUTS[layout],
                        {"folder": folder, "cases": RANK_CASES}, tmp_path)
    for rank, result in enumerate(results):
        for rid, ref in reference["latents"].items():
            ref = torch.tensor(ref)
            assert ref.abs().mean() > 0.3, rid
            diff = float((torch.tensor(result["latents"][rid]) - ref).abs().max())
            assert diff < 1e-5 * float(ref.abs().max()), (rank, rid, diff)
        for rid, branches in result["skipped"].items():     # CFG rank 1 runs "uncond" only
            for branch, skipped in branches.items():
                assert skipped == reference["skipped"][rid][branch], (rank, rid, branch)
