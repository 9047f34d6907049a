"""Wan2.1 image-to-video behind /v1/videos: the tiny I2V folder (omnistage/testing/tiny_wan.py)
served by a real server; a first frame in `input_reference` gives an MP4 of the asked frames
and size, and a request without one is a 400 naming it."""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytest
from PIL import Image

from omnistage.utils.video import decode_video

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

pytest.importorskip("diffusers")

MODEL = "wan-i2v"
REQUEST = {"model": MODEL, "prompt": "a cat on the beach", "size": "48x32", "num_frames": 5,
           "num_inference_steps": 2, "seed": 3}


def first_frame() -> str:
    """A 40x64 PNG (not the asked aspect: stretched to it) as a data URL."""
    pixels = np.random.default_rng(0).integers(0, 256, (40, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
           ) -> Server:
    from omnistage.testing.tiny_wan import build_tiny_wan_i2v

    folder = tmp_path_factory.mktemp("wan_i2v")
    build_tiny_wan_i2v(folder)
    return start_server([str(folder), "--served-model-name", MODEL, "--device", "cpu",
                         "--videos-dir", str(tmp_path_factory.mktemp("videos"))])


def test_a_first_frame_makes_a_video(server: Server) -> None:
    r = server.post("/v1/videos/sync", json={**REQUEST, "input_reference": first_frame()})
    assert r.status_code == 200, r.text
    frames, _ = decode_video(r.content)
    assert frames.shape == (5, 32, 48, 3) and frames.std() > 1.0


def test_no_first_frame_is_a_400(server: Server) -> None:
    for route in ("/v1/videos", "/v1/videos/sync"):
        r = server.post(route, json=REQUEST)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "input_reference"
