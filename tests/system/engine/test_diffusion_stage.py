"""A diffusion stage behind the orchestrator: the digits pipeline served in-process and in a
stage process, with images out and clear errors for bad requests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage import Omni, SamplingParams
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.digits import DigitsPipeline
from omnistage.models.digits_dit import DigitsDiT


def graph(model: Path, backend: str) -> str:
    connector = "inproc" if backend == "inproc" else "shm"
    return (f"model: {model}\nbackend: {backend}\nconnector: {connector}\nstages:\n"
            "  - {name: dit, kind: diffusion, component: digits_dit, final: image}\n")


@pytest.mark.parametrize("backend", ["inproc", "process"])
def test_images_out_equal_the_engine_alone(random_digits: Path, backend: str) -> None:
    params = DiffusionParams(num_inference_steps=5, seed=3, num_images=2, height=32, width=16)
    engine = DiffusionEngine(DigitsPipeline(DigitsDiT.from_pretrained(random_digits),
                                            torch.device("cpu")))
    engine.add_request("ref", "a handwritten 3", params)
    while engine.has_unfinished_requests:
        results = engine.step()
    (ref,) = results
    with Omni(stage_config=graph(random_digits, backend), device="cpu") as omni:
        good, bad = omni.generate(["a handwritten 3", "a picture of a cat"], params)
        assert good.error is None and good.finished
        assert torch.equal(good.tensors["images"], ref.images)
        assert [im.size for im in good.images] == [(16, 32), (16, 32)]
        assert good.stage_metrics["dit"].num_steps == 5
        assert bad.finish_reason == "error"
        assert "stage 'dit'" in str(bad.error) and "names no digit" in str(bad.error)
        with pytest.raises(ValueError, match="num_inference_steps"):
            omni.generate("seven", DiffusionParams(num_inference_steps=0))
        with pytest.raises(ValueError, match="no entry stage takes it"):
            omni.generate("seven", SamplingParams())
        with pytest.raises(ValueError, match="empty"):
            omni.generate("   ")
        (again,) = omni.generate("seven", DiffusionParams(num_inference_steps=2))
        assert again.error is None and again.images[0].size == (64, 64)

