"""BAGEL behind the image routes: a tiny random checkpoint folder in BAGEL-7B-MoT's layout
(omnistage/testing/tiny_bagel.py) picked up by `omnistage serve <folder>` (its ModelFamily row,
configs/bagel.yaml) and served by a real server. /v1/images/generations and /v1/images/edits
make the same images as the pipeline run in this process; chat answers with the image; an edit
without an image and a negative prompt are 400s with OpenAI's error JSON naming the field."""

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

MODEL = "bagel-tiny"
EXTRA = {"seed": 3, "num_inference_steps": 3}
IMAGE = png(28, 20, seed=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnistage.testing.tiny_bagel import build_tiny_bagel

    return build_tiny_bagel(tmp_path_factory.mktemp("bagel") / "BAGEL-tiny")


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], folder: Path) -> Server:
    # BAGEL's weights are ema.safetensors (+ ae.safetensors), no model.safetensors: the
    # start-up check takes any top-level safetensors
    return start_server([str(folder), "--served-model-name", MODEL, "--device", "cpu"])


def _in_process(folder: Path, prompt: str, params: DiffusionParams) -> np.ndarray:
    pipe = load_component("diffusion", "bagel").from_pretrained(
        folder, "bagel", torch.device("cpu"), torch.float32)
    pipe.configure(pipe.Options())
    engine = DiffusionEngine(pipe)
    engine.add_request("r", prompt, params)
    return run_to_end(engine)["r"].images[0].numpy()


def _image(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


def test_generation_as_the_pipeline_makes_it(server: Server, folder: Path) -> None:
    out = server.openai().images.generate(prompt="a red cube", size="24x32", model=MODEL,
                                          extra_body=EXTRA)
    got = _image(out.data[0].b64_json)
    want = _in_process(folder, "a red cube", DiffusionParams(height=32, width=24, **EXTRA))
    assert got.shape == want.shape == (32, 24, 3) and want.std() > 1.0
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def test_edit_as_the_pipeline_makes_it(server: Server, folder: Path) -> None:
    out = server.openai().images.edit(image=("in.png", IMAGE, "image/png"), prompt="make it blue",
                                      model=MODEL, extra_body=EXTRA)
    got = _image(out.data[0].b64_json)
    want = _in_process(folder, "make it blue", DiffusionParams(image=IMAGE, **EXTRA))
    assert got.shape == want.shape == (24, 32, 3)        # the input's resized size
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def test_chat_answers_with_the_image(server: Server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "draw a cube"}],
            "seed": 5, "modalities": ["image"],       # text answers: test_bagel_chat.py
            "sampling_params_list": [None, {"num_inference_steps": 2}]}   # und, dit
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (part,) = r.json()["choices"][0]["message"]["content"]
    assert part["type"] == "image_url"


@pytest.mark.parametrize("path, data, files, param", [
    ("/v1/images/edits", {"prompt": "make it blue"}, None, "image"),
    ("/v1/images/generations", None, None, "negative_prompt"),
], ids=["edit-without-image", "negative-prompt"])
def test_bad_requests_are_400s_naming_the_field(server: Server, path: str, data: dict | None,
                                                files: object, param: str) -> None:
    if data is None:
        r = server.post(path, json={"prompt": "a cube", "model": MODEL,
                                    "negative_prompt": "blurry"})
    else:
        r = server.post(path, data={**data, "model": MODEL}, files=files)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
