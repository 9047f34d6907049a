"""/v1/images/edits with several `image` parts, end to end: a real server on a tiny FLUX.2
[klein] folder and the official `openai` client. Two reference images give the image our
engine draws from the same two (the files reach the stage in order); bad references are 400s
naming `image` (or the part, `image[1]`), before or in the stage."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.registry import load_component
from omnistage.testing.diffusion import png, run_to_end
from omnistage.testing.tiny_flux2 import build_tiny_flux2_klein

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

pytest.importorskip("diffusers")
PROMPT = "a photo of the sea shore"


@pytest.fixture(scope="module")
def klein(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("flux2_klein")
    build_tiny_flux2_klein(path)
    return path


@pytest.fixture(scope="module")
def server(klein: Path, start_server: Callable[..., Server]) -> Server:
    return start_server([str(klein)])


def test_two_reference_images_edit_as_the_engine_does(klein: Path, server: Server) -> None:
    first, second = png(64, 72, seed=1), png(80, 64, seed=2)
    out = server.openai().images.edit(
        image=[("a.png", first, "image/png"), ("b.png", second, "image/png")], prompt=PROMPT,
        extra_body={"seed": 3, "num_inference_steps": 2, "guidance_scale": 2.0})
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json))))
    assert out.size == "64x72" and got.shape == (72, 64, 3)

    pipe = load_component("diffusion", "flux2_klein").from_pretrained(
        klein, "flux2_klein", torch.device("cpu"), torch.float32)
    engine = DiffusionEngine(pipe)
    engine.add_request("a", PROMPT, DiffusionParams(num_inference_steps=2, guidance_scale=2.0,
                                                    seed=3, image=first, extra_images=(second,)))
    expected = run_to_end(engine)["a"].images[0].numpy()
    assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1


@pytest.mark.parametrize("files, param, match", [
    ([png(64, 64, seed=i) for i in range(11)], "image", "at most 10 image files, got 11"),
    ([png(64, 64, seed=1), png(48, 64, seed=2)], "image[1]", "48x64 is too small"),
], ids=["eleven", "too-small"])
def test_bad_reference_images_are_400s(server: Server, files: list[bytes], param: str,
                                       match: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        server.openai().images.edit(image=[(f"{i}.png", f, "image/png")
                                           for i, f in enumerate(files)],
                                    prompt=PROMPT, extra_body={"num_inference_steps": 2})
    assert err.value.body["param"] == param and match in err.value.body["message"]


def test_strength_is_refused(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        server.openai().images.edit(image=("a.png", png(64, 64, seed=1), "image/png"),
                                    prompt=PROMPT, extra_body={"strength": 0.5})
    assert err.value.body["param"] == "strength"


@pytest.mark.parametrize("key", ["image", "extra_images"])
def test_images_come_as_files_not_params(server: Server, key: str) -> None:
    (model,) = [m["id"] for m in server.get("/v1/models").json()["data"]]
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "sampling_params_list": [{key: ["aGVsbG8="]}]}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == f"sampling_params_list[0].{key}"
