"""Wan text-to-video behind /v1/videos: the tiny Wan2.1 folder (omnistage/testing/tiny_wan.py)
served by a real server; its VideoSpec checks a request, /v1/videos/sync returns an MP4 of
the asked frames and size, and a job runs to `completed` with its file."""

from __future__ import annotations

import base64
import io
import time
from typing import TYPE_CHECKING, Callable

import pytest
from PIL import Image

from omnistage.utils.video import decode_video

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

pytest.importorskip("diffusers")

MODEL = "wan"
REQUEST = {"model": MODEL, "prompt": "a cat on the beach", "size": "48x32", "num_frames": 5,
           "num_inference_steps": 2, "seed": 3}


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
           ) -> Server:
    from omnistage.testing.tiny_wan import build_tiny_wan

    folder = tmp_path_factory.mktemp("wan")
    build_tiny_wan(folder)
    return start_server([str(folder), "--served-model-name", MODEL, "--device", "cpu",
                         "--videos-dir", str(tmp_path_factory.mktemp("videos"))])


def test_sync_and_job(server: Server) -> None:
    r = server.post("/v1/videos/sync", json=REQUEST)
    assert r.status_code == 200, r.text
    frames, _ = decode_video(r.content)
    assert frames.shape == (5, 32, 48, 3) and frames.std() > 1.0
    job = server.post("/v1/videos", json=REQUEST).json()
    deadline = time.monotonic() + 60
    while job["status"] not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
        job = server.get(f"/v1/videos/{job['id']}").json()
    assert job["status"] == "completed", job
    again, _ = decode_video(server.get(f"/v1/videos/{job['id']}/content").content)
    assert again.shape == frames.shape and abs(int(again.astype(int).sum())
                                               - int(frames.astype(int).sum())) < frames.size


def test_the_video_spec_refuses_bad_shapes(server: Server) -> None:
    for bad in ({"num_frames": 6}, {"size": "40x32"}):
        r = server.post("/v1/videos", json={**REQUEST, **bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"]



def test_a_first_frame_is_refused_by_text_to_video(server: Server) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (48, 32), (200, 40, 90)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    r = server.post("/v1/videos", json={**REQUEST, "input_reference": url})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "image_to_video_not_supported"
