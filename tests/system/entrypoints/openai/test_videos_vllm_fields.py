"""/v1/videos as vLLM-Omni's video clients use it (examples/online_serving/text_to_video and
image_to_video in the vllm-project/vllm-omni repository, written here from their documented
protocol): the multipart form of `curl -F` with `width` / `height`, `num_frames`, `fps`,
`negative_prompt`, `num_inference_steps`, `guidance_scale(_2)`, `boundary_ratio`,
`flow_shift` and `seed`; the job read back as they read it (the create answer's `id`, GET
until `status` is completed, then GET .../content), the sync route's file and its headers,
the JSON-safe `image_reference`, the `video_params` object. The fields accepted and ignored
are named in X-Omnistage-Ignored. Served by the toy video model (frames known exactly)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from PIL import Image

from omnistage.testing.toy_video import expected_frames
from tests.system.entrypoints.openai.test_videos import (
    check_video,
    error_of,
    finished,
    png,
    serve_args,
)

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

HEADER = "x-omnistage-ignored"
NEGATIVE = "low quality, blurry, static"


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from omnistage.testing.toy_video import build_toy_video
    return build_toy_video(tmp_path_factory.mktemp("toy_video_vllm"))


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], toy: tuple[Path, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Server:
    # started as a vLLM-Omni user would: the model and the port (plus the test's folders)
    return start_server(serve_args(toy, tmp_path_factory.mktemp("videos_vllm")))


def form(**fields: object) -> dict[str, tuple[None, str]]:
    """`curl -F name=value` for each field: multipart parts without a filename."""
    return {k: (None, v if isinstance(v, str) else json.dumps(v)) for k, v in fields.items()}


# what vLLM-Omni's README sends (its "Generation with Parameters"), at the toy's scale
WAN_FORM = {"prompt": "A cinematic view of a futuristic city at sunset", "width": 64,
            "height": 32, "num_frames": 9, "negative_prompt": NEGATIVE, "fps": 16,
            "num_inference_steps": 2, "guidance_scale": 4.0, "guidance_scale_2": 4.0,
            "boundary_ratio": 0.875, "flow_shift": 5.0, "seed": 42}


def test_the_curl_job_runs_as_their_client_reads_it(server: Server) -> None:
    r = server.post("/v1/videos", files=form(**WAN_FORM), headers={"Accept": "application/json"})
    assert r.status_code == 200, r.text
    # boundary_ratio / flow_shift reach the model (Wan's schedule); the toy has none, which
    # its stage decides at run time: a job's create answer cannot say, the sync answer does
    assert HEADER not in r.headers
    job = r.json()
    assert job["status"] == "queued" and job["object"] == "video" and job["size"] == "64x32"
    assert finished(server, job["id"])["status"] == "completed"     # their loop: GET .status
    content = server.get(f"/v1/videos/{job['id']}/content")        # curl -L .../content
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    check_video(content.content, expected_frames(WAN_FORM["prompt"], 42, 9, 32, 64), 16)


def test_sync_answers_the_file_with_their_headers(server: Server) -> None:
    body = {**WAN_FORM, "prompt": "Two cats boxing", "width": 32, "height": 48, "seed": 3}
    r = server.post("/v1/videos/sync", files=form(**body))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "video/mp4"
    assert r.headers["x-model"] == "toy-video" and r.headers["x-request-id"]
    assert float(r.headers["x-inference-time-s"]) > 0
    assert r.headers[HEADER] == "boundary_ratio, flow_shift"
    check_video(r.content, expected_frames("Two cats boxing", 3, 9, 48, 32), 16)


@pytest.mark.parametrize(("size", "fields", "made"), [
    (None, {"width": 32}, "32x48"),                    # the other side: the model's default
    (None, {"height": 32}, "64x32"),
    ("32x16", {"width": 32, "height": 16}, "32x16"),   # both ways, agreeing
    ("32x16", {}, "32x16"),
])
def test_width_and_height_make_the_size(server: Server, size: str | None,
                                        fields: dict[str, int], made: str) -> None:
    body = {"prompt": "a kite", "num_inference_steps": 1, **fields,
            **({"size": size} if size else {})}
    r = server.post("/v1/videos", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["size"] == made and HEADER not in r.headers


@pytest.mark.parametrize(("body", "param"), [
    ({"size": "64x48", "width": 32}, "width"),          # size and width disagree
    ({"size": "64x48", "height": 32}, "height"),
    ({"width": 40}, "width"),                           # not a multiple of 16
    ({"height": 512}, "height"),                        # beyond --max-video-size
    ({"width": 0}, "width"),
    ({"boundary_ratio": 1.5}, "boundary_ratio"),
    ({"flow_shift": -1.0}, "flow_shift"),
    ({"video_params": {"width": 40}}, "width"),
    ({"video_params": {"colour": 1}}, "video_params.colour"),
    ({"image_reference": {"file_id": "file-1"}}, "image_reference.file_id"),
    ({"image_reference": {"url": "x"}}, "image_reference"),
    ({"extra_params": {"sample_solver": "euler"}}, "extra_params"),
])
def test_bad_vllm_fields_are_400_naming_them(server: Server, body: dict, param: str) -> None:
    r = server.post("/v1/videos", json={"prompt": "a kite", **body})
    assert error_of(r, 400)["param"] == param


def test_a_form_field_that_disagrees_is_400(server: Server) -> None:
    r = server.post("/v1/videos/sync", files=form(prompt="a kite", size="64x48", width=32))
    assert error_of(r, 400)["param"] == "width"
    r = server.post("/v1/videos", files=form(prompt="a kite", video_params="{not json"))
    assert error_of(r, 400)["param"] == "video_params"


def test_video_params_fill_what_the_top_level_leaves_out(server: Server) -> None:
    body = {"prompt": "a boat", "seed": 5, "num_inference_steps": 1, "width": 32,
            "video_params": {"width": 64, "height": 32, "num_frames": 5, "fps": 10}}
    r = server.post("/v1/videos/sync", json=body)
    assert r.status_code == 200, r.text
    check_video(r.content, expected_frames("a boat", 5, 5, 32, 32), 10)


def test_image_reference_is_the_first_frame(server: Server) -> None:
    url = "data:image/png;base64," + base64.b64encode(png((200, 40, 10))).decode()
    body = {"prompt": "a bear", "seed": 1, "num_inference_steps": 1, "size": "32x32",
            "num_frames": 5, "fps": 8}
    first = Image.new("RGB", (40, 30), (200, 40, 10))
    expected = expected_frames("a bear", 1, 5, 32, 32, first)
    r = server.post("/v1/videos/sync", files=form(**body, image_reference={"image_url": url}))
    assert r.status_code == 200, r.text
    check_video(r.content, expected, 8)
    both = server.post("/v1/videos/sync", data={**body, "image_reference": json.dumps(
        {"image_url": url})}, files={"input_reference": ("a.png", png((1, 2, 3)), "image/png")})
    assert error_of(both, 400)["param"] == "image_reference"


def test_true_cfg_scale_is_accepted_and_named_ignored(server: Server) -> None:
    r = server.post("/v1/videos", json={"prompt": "a kite", "num_inference_steps": 1,
                                        "true_cfg_scale": 4.0, "user": "u1"})
    assert r.status_code == 200, r.text
    assert r.headers[HEADER] == "true_cfg_scale, user"
