"""The generic diffusers adapter through the offline front doors: `Omni` and `omnistage
generate` serve the tiny random SDXL folder (no native port) with diffusers' own images, and
a folder of a pipeline that outputs no images is refused at load, naming its class."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage import DiffusionParams, Omni
from omnistage.entrypoints.cli.main import main
from omnistage.testing.tiny_sdxl import reference

diffusers = pytest.importorskip("diffusers")

INPROC = {"backend": "inproc", "connector": "inproc"}
SIZE = {"height": 16, "width": 16, "num_inference_steps": 2}


def assert_close(image: np.ndarray, expected: torch.Tensor) -> None:
    """Equal to diffusers' image up to one level of 255 (a batch's float rounding)."""
    assert image.shape == tuple(expected.shape)
    assert np.abs(image.astype(int) - expected.numpy().astype(int)).max() <= 1


def test_omni_and_the_cli_serve_a_diffusers_folder(tiny_sdxl: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    pipe = diffusers.DiffusionPipeline.from_pretrained(tiny_sdxl)
    prompts = ["a cat", "a dog"]
    with Omni(str(tiny_sdxl), device="cpu", **INPROC) as omni:
        outs = omni.generate(prompts, DiffusionParams(**SIZE, seed=5))
    for prompt, out in zip(prompts, outs):
        (image,) = out.images
        assert_close(np.asarray(image), reference(pipe, prompt, 5, **SIZE)[0])
    rc = main(["generate", str(tiny_sdxl), "--prompt", "a dog", "--steps", "2", "--height",
               "16", "--width", "16", "--seed", "7", "--device", "cpu", "--output-dir",
               str(tmp_path), *[a for k, v in INPROC.items()
                                for a in ("--stage-override", f"{k}={v}")]])
    assert rc == 0
    (path,) = capsys.readouterr().out.split()
    assert_close(np.asarray(Image.open(path)), reference(pipe, "a dog", 7, **SIZE)[0])


def test_a_pipeline_without_image_output_is_refused_at_load(tmp_path: Path) -> None:
    # the class is checked before any weight loads: model_index.json alone is enough
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "AudioLDM2Pipeline"}))
    with pytest.raises(RuntimeError, match="AudioLDM2Pipeline: it outputs audio"):
        Omni(str(tmp_path), device="cpu", **INPROC)
