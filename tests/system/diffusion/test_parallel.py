"""A diffusion stage over two CPU ranks (gloo, one process each) against the same stage on one
rank: a tiny random Qwen-Image with true CFG, batched requests of different caption lengths
(masked), CFG and not, two images per prompt, an odd image token count (48x48: 3x3 tokens)
and odd caption lengths, and step caching. CFG-parallel, Ulysses, ring and tensor
parallelism each give every rank the 1-rank latents within 1e-5, and skip the same steps;
so do two pairs of axes on four ranks.
Z-Image (CFG-parallel, TP) the same; FLUX's and Wan's transformers (Ulysses, ring, TP) one
forward.
Layouts a pipeline cannot run are refused before anything loads.

The sequence-parallel attention alone (layers/sequence_parallel.py) is checked against
whole-sequence attention, for uneven splits and masked keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.configs.schema import ParallelSizes, StageConfig
from omnistage.stages.ranks import check_heads_divide
from omnistage.layers.groups import StageRanks
from omnistage.testing.diffusion_ranks import (CASES, build_tiny_flux_transformer,
                                               build_tiny_qwen_image, build_tiny_wan_transformer,
                                               build_tiny_z_image, flux_forward, pipeline_run,
                                               WAN_CASES, wan_forward, wan_run)
from omnistage.testing.ranks import run_ranks

pytest.importorskip("diffusers")

TARGET = "omnistage.testing.diffusion_ranks"
LAYOUTS = {"cfg2": ParallelSizes(cfg=2), "ulysses2": ParallelSizes(ulysses=2),
           "ring2": ParallelSizes(ring=2), "tp2": ParallelSizes(tp=2),
           # four ranks: the axes together (heads 2 = ulysses x tp at most)
           "cfg2-ulysses2": ParallelSizes(cfg=2, ulysses=2),
           "ring2-tp2": ParallelSizes(ring=2, tp=2),
           "ring2-ulysses2": ParallelSizes(ring=2, ulysses=2),
           "ulysses2-tp2": ParallelSizes(ulysses=2, tp=2)}     # Wan's 4 heads


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen_image(tmp_path_factory.mktemp("qwen_image"))


@pytest.fixture(scope="module")
def reference(folder: Path) -> dict:
    """The cases on one rank, in this process."""
    return pipeline_run(StageRanks.single(), str(folder), CASES)


def assert_latents_close(got: dict[str, list[float]], reference: dict, rel: bool = False
                         ) -> None:
    """Within 1e-5 (rel: of the largest reference value) for every request."""
    for rid, ref in reference["latents"].items():
        ref = torch.tensor(ref)
        scale = float(ref.abs().max())
        assert scale > 1.0, (rid, "latents too small to compare")
        diff = float((torch.tensor(got[rid]) - ref).abs().max())
        assert diff < 1e-5 * (scale if rel else 1.0), (rid, diff, scale)


@pytest.mark.parametrize("layout", ["cfg2", "ulysses2", "ring2", "tp2", "cfg2-ulysses2",
                                    "ring2-tp2"])
def test_latents_match_one_rank(folder: Path, reference: dict, layout: str,
                                tmp_path: Path) -> None:
    results = run_ranks(f"{TARGET}:pipeline_run", LAYOUTS[layout],
                        {"folder": str(folder), "cases": CASES}, tmp_path)
    for rank, result in enumerate(results):
        assert set(result["latents"]) == {c["id"] for c in CASES}, rank
        assert_latents_close(result["latents"], reference)
        for rid, branches in result["skipped"].items():     # CFG rank 1 runs "uncond" only
            for branch, skipped in branches.items():
                assert skipped == reference["skipped"][rid][branch], (rank, rid, branch)
    assert all(r["latents"] == results[0]["latents"] for r in results)  # equal, exactly


def test_graphed_forwards_match_one_rank(folder: Path, reference: dict, tmp_path: Path
                                         ) -> None:
    """Ulysses 2 with the forwards replayed from (emulated) CUDA graphs: the ranks capture
    the same shapes at the same step, so the all-to-alls inside stay paired."""
    results = run_ranks(f"{TARGET}:pipeline_run", LAYOUTS["ulysses2"],
                        {"folder": str(folder), "cases": CASES, "graphs": True}, tmp_path)
    for result in results:
        assert_latents_close(result["latents"], reference)
        assert result["replays"] >= 2
    assert results[0]["replays"] == results[1]["replays"]


def test_stage_follows_rank_zero(folder: Path, reference: dict, tmp_path: Path) -> None:
    """A CFG-parallel DiffusionStage (its conditioning along an input edge): rank 1 follows
    (`DiffusionStage.follow`), rank 0 serves and stops it."""
    results = run_ranks(f"{TARGET}:qwen_image_stage_run", ParallelSizes(cfg=2),
                        {"folder": str(folder), "cases": CASES}, tmp_path)
    assert results[1] == {}
    assert_latents_close(results[0]["latents"], reference)


@pytest.fixture(scope="module")
def z_image(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """The tiny Z-Image folder and the cases' latents on one rank."""
    folder = str(build_tiny_z_image(tmp_path_factory.mktemp("z_image")))
    return folder, pipeline_run(StageRanks.single(), folder, CASES, "z_image")


@pytest.mark.parametrize("layout", ["cfg2", "tp2", "ulysses2", "ring2"])
def test_z_image_latents_match_one_rank(z_image: tuple[str, dict], layout: str,
                                        tmp_path: Path) -> None:
    """Z-Image's CFG (guidance_scale with a negative caption), TP (its SwiGLU's 128 hidden
    features split) and sequence parallelism (the main layers' joint batch split; step caching
    on one request). Larger activations: relative 1e-5."""
    folder, reference = z_image
    results = run_ranks(f"{TARGET}:pipeline_run", LAYOUTS[layout],
                        {"folder": folder, "cases": CASES, "pipeline": "z_image"}, tmp_path)
    for rank, result in enumerate(results):
        assert_latents_close(result["latents"], reference, rel=True)
        for rid, branches in result["skipped"].items():     # CFG rank 1 runs "uncond" only
            for branch, skipped in branches.items():
                assert skipped == reference["skipped"][rid][branch], (rank, rid, branch)


@pytest.mark.parametrize("layout", ["ulysses2", "ring2", "tp2"])
def test_flux_transformer_matches_one_rank(tmp_path_factory: pytest.TempPathFactory,
                                           layout: str, tmp_path: Path) -> None:
    """One forward of FLUX.1-dev's transformer (double and single blocks, 7 caption and 3x3
    image tokens: both split unevenly)."""
    folder = str(build_tiny_flux_transformer(tmp_path_factory.mktemp("flux")))
    kwargs = {"folder": folder, "num_txt": 7, "grid": [3, 3]}
    reference = torch.tensor(flux_forward(StageRanks.single(), **kwargs))
    assert reference.abs().max() > 1.0
    for result in run_ranks(f"{TARGET}:flux_forward", LAYOUTS[layout], kwargs, tmp_path):
        assert (torch.tensor(result) - reference).abs().max() < 1e-5


@pytest.mark.parametrize("layout", ["ulysses2-tp2"])
def test_wan_transformer_matches_one_rank(tmp_path_factory: pytest.TempPathFactory,
                                          layout: str, tmp_path: Path) -> None:
    """One forward of Wan2.1 I2V's transformer (3x3x1 video tokens: split unevenly; image
    tokens; a timestep per token, sliced with them)."""
    folder = str(build_tiny_wan_transformer(tmp_path_factory.mktemp("wan")))
    kwargs = {"folder": folder, "grid": [3, 3, 1]}
    reference = torch.tensor(wan_forward(StageRanks.single(), **kwargs))
    assert reference.abs().max() > 1.0
    for result in run_ranks(f"{TARGET}:wan_forward", LAYOUTS[layout], kwargs, tmp_path):
        assert (torch.tensor(result) - reference).abs().max() < 1e-5


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """The tiny Wan2.2 A14B folder (two experts) and WAN_CASES' latents on one rank."""
    from omnistage.testing.tiny_wan import build_tiny_wan22_a14b

    folder = tmp_path_factory.mktemp("wan")
    build_tiny_wan22_a14b(folder)
    return str(folder), wan_run(StageRanks.single(), str(folder), WAN_CASES)


@pytest.mark.parametrize("layout", ["cfg2", "cfg2-ulysses2"])
def test_wan_latents_match_one_rank(wan: tuple[str, dict], layout: str, tmp_path: Path
                                    ) -> None:
    """The Wan pipeline split (issue 21: A14B on 2 GPUs): CFG-parallel, alone and with
    Ulysses; requests crossing the experts' boundary with a scale each, one without CFG, one
    step-cached: every rank ends with the 1-rank latents and skips the same steps per branch
    and expert."""
    folder, reference = wan
    assert sum(reference["skipped"]["c"].values()) > 0          # the cache is exercised
    results = run_ranks(f"{TARGET}:wan_run", LAYOUTS[layout],
                        {"folder": folder, "cases": WAN_CASES}, tmp_path)
    for rank, result in enumerate(results):
        assert_latents_close(result["latents"], reference, rel=True)
        for rid, branches in result["skipped"].items():     # CFG rank 1 runs "uncond" only
            for branch, skipped in branches.items():
                assert skipped == reference["skipped"][rid][branch], (rank, rid, branch)


@pytest.mark.parametrize("layout", ["ulysses2", "ring2", "ring2-ulysses2"])
def test_sequence_parallel_attention(layout: str, tmp_path: Path) -> None:
    """Segments split unevenly (7 and 9 tokens), one rank without text (1), masked text keys."""
    cases = [([7, 9], True), ([1, 5], False), ([6, 16], True)]
    results = run_ranks(f"{TARGET}:sequence_attention", LAYOUTS[layout], {"cases": cases},
                        tmp_path)
    for rank in results:
        for case, r in zip(cases, rank):
            assert r["scale"] > 0.5 and r["diff"] < 1e-5, (case, r)


def test_omni_refuses_before_any_stage_starts(folder: Path) -> None:
    """The front door's check (stages/ranks.py) reads the pipeline's layout rules: no stage
    process is started for a layout its model cannot run."""
    from omnistage import Omni

    with pytest.raises(ValueError, match=r"^stage 'dit': .*not divisible by ulysses_degree"):
        Omni(str(folder), device="cpu", ulysses_degree=2, tensor_parallel_size=2)
    flux = StageConfig(name="dit", kind="diffusion", component="flux", final="image",
                       parallel=ParallelSizes(cfg=2))
    with pytest.raises(ValueError, match=r"stage 'dit': cfg_parallel_size=2: the 'flux' "
                                         r"pipeline does not split along this axis"):
        check_heads_divide(flux, str(folder))
