"""HunyuanVideo-1.5 behind /v1/videos: the tiny t2v and i2v folders (tests/helpers/
hunyuan_video15.py, with their tiny Qwen2.5-VL and byT5) served by real servers; the VideoSpec
checks a request (frames 1 + 4k, sizes multiples of the VAE's factor), /v1/videos/sync returns
an MP4 of the asked frames and size; i2v takes its first frame from input_reference and
refuses a request without one (400 naming the image)."""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING, Callable

import pytest
from PIL import Image

from omnistage.utils.video import decode_video

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

pytest.importorskip("diffusers")

REQUEST = {"prompt": 'a sign that says "hello"', "size": "40x24", "num_frames": 5,
           "num_inference_steps": 2, "seed": 3}


def _serve(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory,
           name: str, build) -> Server:
    folder = tmp_path_factory.mktemp(name)
    build(folder)
    return start_server([str(folder), "--served-model-name", name, "--device", "cpu",
                         "--videos-dir", str(tmp_path_factory.mktemp("videos"))])


@pytest.fixture(scope="module")
def t2v(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
        ) -> Server:
    from tests.helpers.hunyuan_video15 import build_tiny_t2v

    return _serve(start_server, tmp_path_factory, "hv15",
                  lambda folder: build_tiny_t2v(folder, text=True))


def test_t2v_sync_and_bad_shapes(t2v: Server) -> None:
    r = t2v.post("/v1/videos/sync", json={**REQUEST, "model": "hv15"})
    assert r.status_code == 200, r.text
    frames, _ = decode_video(r.content)
    assert frames.shape == (5, 24, 40, 3) and frames.std() > 1.0
    for bad in ({"num_frames": 6}, {"size": "44x24"}):
        r = t2v.post("/v1/videos", json={**REQUEST, "model": "hv15", **bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"]


def test_i2v_takes_its_first_frame(start_server: Callable[..., Server],
                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.helpers.hunyuan_video15 import build_tiny_i2v

    server = _serve(start_server, tmp_path_factory, "hv15i2v",
                    lambda folder: build_tiny_i2v(folder, text=True))
    buf = io.BytesIO()
    Image.new("RGB", (64, 40), (200, 40, 90)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {**REQUEST, "model": "hv15i2v"}
    r = server.post("/v1/videos/sync", json={**body, "input_reference": url})
    assert r.status_code == 200, r.text
    frames, _ = decode_video(r.content)
    assert frames.shape == (5, 24, 40, 3)
    r = server.post("/v1/videos", json=body)
    assert r.status_code == 400, r.text
    assert "input_reference" in r.text or "image" in r.text
