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
from omnistage.diffusion.parallel import check_layout
from omnistage.diffusion.pipelines.digits import DigitsPipeline
from omnistage.diffusion.pipelines.flux import FluxPipeline
from omnistage.diffusion.pipelines.qwen_image import QwenImagePipeline
from omnistage.diffusion.pipelines.z_image import ZImagePipeline
from omnistage.layers.groups import StageRanks
from omnistage.testing.diffusion_ranks import (CASES, build_tiny_qwen_image, build_tiny_z_image, pipeline_run,
                                               WAN_CASES, wan_run)

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


def test_reference_depends_on_what_the_ranks_split(folder: Path, reference: dict) -> None:
    """A mistake in what the parallel runs share (a negative caption token, CFG scale) moves
    the latents far beyond the tolerance, and step caching skipped steps."""
    cases = [dict(c, neg_len=c["neg_len"] - 1) if c["id"] == "c" else c for c in CASES]
    other = pipeline_run(StageRanks.single(), str(folder), cases)
    diff = (torch.tensor(other["latents"]["c"]) - torch.tensor(reference["latents"]["c"]))
    assert diff.abs().max() > 1e-2
    assert reference["skipped"]["e"] == {"cond": 2, "uncond": 2}


@pytest.fixture(scope="module")
def z_image(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """The tiny Z-Image folder and the cases' latents on one rank."""
    folder = str(build_tiny_z_image(tmp_path_factory.mktemp("z_image")))
    return folder, pipeline_run(StageRanks.single(), folder, CASES, "z_image")


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """The tiny Wan2.2 A14B folder (two experts) and WAN_CASES' latents on one rank."""
    from omnistage.testing.tiny_wan import build_tiny_wan22_a14b

    folder = tmp_path_factory.mktemp("wan")
    build_tiny_wan22_a14b(folder)
    return str(folder), wan_run(StageRanks.single(), str(folder), WAN_CASES)


@pytest.mark.parametrize("pipeline, name, sizes, match", [
    (QwenImagePipeline, "qwen_image", ParallelSizes(ulysses=2, tp=2),
     r"num_attention_heads \(2\) is not divisible by ulysses_degree x tensor_parallel_size"),
    (QwenImagePipeline, "qwen_image", ParallelSizes(cfg=3), "two branches"),
    (ZImagePipeline, "z_image", ParallelSizes(cfg=4), "two branches"),
    (FluxPipeline, "flux", ParallelSizes(cfg=2), "cfg_parallel_size=2: .* runs none"),
    (DigitsPipeline, "digits", ParallelSizes(tp=2), "supports none"),
])
def test_refused_layouts(folder: Path, pipeline: type, name: str, sizes: ParallelSizes,
                         match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_layout(pipeline, name, sizes, folder)


def test_stage_refuses_before_loading(folder: Path) -> None:
    from omnistage.stages.diffusion import DiffusionStage

    with pytest.raises(ValueError, match="not divisible"):
        DiffusionStage(StageConfig(name="dit", kind="diffusion", component="qwen_image",
                                   model=str(folder), parallel=ParallelSizes(ulysses=2, tp=2)),
                       None, "cpu")
    with pytest.raises(ValueError, match="text-encoder stage runs on one rank"):
        DiffusionStage(StageConfig(name="enc", kind="diffusion",
                                   component="qwen_image.text_encoder", model=str(folder),
                                   parallel=ParallelSizes(tp=2)), None, "cpu")

