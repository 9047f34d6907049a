"""The generic diffusers adapter behind a real server: the tiny random SDXL folder (no native
port) is listed in /v1/models and logged as not native, and /v1/images/generations answers
two concurrent requests with the images diffusers makes of each alone."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytest
from PIL import Image

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

diffusers = pytest.importorskip("diffusers")

MODEL = "tiny-sdxl"
REQUEST = {"model": MODEL, "size": "16x16", "num_inference_steps": 2, "guidance_scale": 3.0}


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], tiny_sdxl: Path) -> Server:
    # in-process stages: one interpreter loads torch and diffusers, not two
    return start_server([str(tiny_sdxl), "--served-model-name", MODEL, "--device", "cpu",
                         "--stage-override", "backend=inproc"])


def test_models_and_the_log_say_not_native(server: Server) -> None:
    (card,) = server.get("/v1/models").json()["data"]
    assert card["native"] is False and card["backend"] == "diffusers"
    assert card["pipeline"] == "StableDiffusionXLPipeline" and card["modalities"] == ["image"]
    assert "StableDiffusionXLPipeline has no native omnistage port" in server.log.read_text()


def test_concurrent_generations_equal_diffusers_alone(server: Server, tiny_sdxl: Path) -> None:
    from omnistage.testing.tiny_sdxl import reference

    cases = [("a cat", 11), ("a dog", 12)]

    def generate(case: tuple[str, int]) -> np.ndarray:
        r = server.post("/v1/images/generations",
                        json={**REQUEST, "prompt": case[0], "seed": case[1]})
        assert r.status_code == 200, r.text
        (data,) = r.json()["data"]
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(data["b64_json"]))))

    with ThreadPoolExecutor(2) as pool:
        images = list(pool.map(generate, cases))
    pipe = diffusers.DiffusionPipeline.from_pretrained(tiny_sdxl)
    for (prompt, seed), image in zip(cases, images):
        expected = reference(pipe, prompt, seed, height=16, width=16, num_inference_steps=2,
                             guidance_scale=3.0)[0].numpy()
        assert image.shape == expected.shape
        assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1
    r = server.post("/v1/images/generations", json={**REQUEST, "prompt": "x",
                                                    "true_cfg_scale": 4.0})
    assert r.status_code == 400 and "true_cfg_scale" in r.json()["error"]["message"]
