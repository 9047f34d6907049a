"""HunyuanImage-3.0 behind /v1/images/generations: the tiny random checkpoint of
tests/fixtures/hunyuan_image3 (rebuilt from its seed) picked up by `omnistage serve <folder>` (its
ModelFamily row, configs/hunyuan_image3.yaml) and served by a real server. The answer is the
upstream code's image for the same prompt, seed and settings (the fixture), and the pipeline's
run in this process; a size outside the checkpoint's resolution group and a negative prompt are
400s with OpenAI's error JSON naming the field."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytest
from PIL import Image

from tests.helpers.hunyuan_image3 import build_checkpoint, expected, manifest

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "hunyuan-image3-tiny"


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
           ) -> Server:
    folder: Path = build_checkpoint(tmp_path_factory.mktemp("hi3") / "HunyuanImage-3.0-tiny")
    return start_server([str(folder), "--served-model-name", MODEL, "--device", "cpu"])


def test_generation_is_the_upstream_image(server: Server) -> None:
    case = manifest()["cases"]["wide"]          # its settings are the folder's defaults
    h, w = case["image_size"]
    out = server.openai().images.generate(
        prompt=case["prompts"][0], size=f"{w}x{h}", model=MODEL,
        extra_body={"seed": case["seeds"][0], "num_inference_steps": case["steps"]})
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json))))
    want = expected()["wide.image"][0, :, 0].permute(1, 2, 0)
    want = ((want / 2 + 0.5).clamp(0, 1) * 255).round().numpy().astype(int)
    assert got.shape == (h, w, 3) and want.std() > 1.0
    assert np.abs(got.astype(int) - want).max() <= 1


@pytest.mark.parametrize("body, param", [
    ({"size": "30x30"}, "size"),
    ({"negative_prompt": "blurry"}, "negative_prompt"),
], ids=["size-not-in-group", "negative-prompt"])
def test_bad_requests_are_400s_naming_the_field(server: Server, body: dict, param: str) -> None:
    r = server.post("/v1/images/generations", json={"prompt": "a cat", "model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
