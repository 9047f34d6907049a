"""Qwen-Image-Edit-Plus behind /v1/images/edits: a tiny random folder
(omnistage/testing/tiny_qwen_image_edit.py) served by a real server. Two `image[]` parts make
the same image as the pipeline run in this process with the two images in that order; no
image, too many (as files or as chat image parts) and an undecodable one are 400s with
OpenAI's error JSON naming `image`, answered before any stage runs."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.registry import load_component
from omnistage.testing.diffusion import png, run_to_end

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

pytest.importorskip("diffusers")

MODEL = "qwen-image-edit-plus"
PROMPT = "put the cat on the sofa"
EXTRA = {"seed": 3, "num_inference_steps": 2, "negative_prompt": "blurry",
         "true_cfg_scale": 4.0}
IMAGES = [png(40, 24, seed=1), png(24, 32, seed=2)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnistage.testing.tiny_qwen_image_edit import build_tiny_qwen_image_edit

    path = tmp_path_factory.mktemp("qwen_image_edit_plus")
    build_tiny_qwen_image_edit(path, plus=True)
    return path


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], folder: Path) -> Server:
    return start_server([str(folder), "--served-model-name", MODEL, "--device", "cpu"])


def test_two_images_edit_as_the_pipeline_does(server: Server, folder: Path) -> None:
    out = server.openai().images.edit(
        image=[("a.png", IMAGES[0], "image/png"), ("b.png", IMAGES[1], "image/png")],
        prompt=PROMPT, size="64x64", model=MODEL, extra_body=EXTRA)
    (data,) = out.data
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(data.b64_json))))

    pipe = load_component("diffusion", "qwen_image_edit_plus").from_pretrained(
        folder, "qwen_image_edit_plus", torch.device("cpu"), torch.float32)
    engine = DiffusionEngine(pipe)
    engine.add_request("r", PROMPT, DiffusionParams(height=64, width=64, image=IMAGES[0],
                                                    extra_images=(IMAGES[1],), **EXTRA))
    expected = run_to_end(engine)["r"].images[0].numpy()                 # (H, W, 3) uint8
    assert got.shape == expected.shape == (64, 64, 3) and expected.std() > 1.0
    assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1    # server: 1 thread


@pytest.mark.parametrize("images, message", [
    ([], "image file is required"),
    ([IMAGES[0]] * 4, "at most 3 input images, got 4"),
    ([IMAGES[0], b"not an image"], "not an image in a format this server reads"),
], ids=["none", "four", "undecodable"])
def test_bad_images_are_400s(server: Server, images: list[bytes], message: str) -> None:
    files = [("image[]", (f"{i}.png", data, "image/png")) for i, data in enumerate(images)]
    r = server.post("/v1/images/edits", data={"prompt": PROMPT, "model": MODEL},
                    files=files or None)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "image" and message in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_chat_image_parts_count_too(server: Server) -> None:
    """Image parts of a chat message are the edit's images as well: four are a 400."""
    url = "data:image/png;base64," + base64.b64encode(IMAGES[0]).decode()
    content = [{"type": "text", "text": PROMPT}] + [{"type": "image_url",
                                                     "image_url": {"url": url}}] * 4
    r = server.post("/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "image" and "at most 3 input images, got 4" in error["message"]
