"""/v1/videos through a real server serving the toy video model (omnistage/testing/
toy_video.py: frames known from the prompt, the seed and the size), with the official
`openai` client where it has the call: jobs created, polled and downloaded (frames decoded
and compared), other formats, image-to-video, the sync route, list pagination, cancel and
delete of a running job, a failing job that ends failed while the next one completes, every
limit's 4xx, and the jobs kept across a restart (completed ones downloadable, interrupted
and queued ones run again)."""

from __future__ import annotations

import base64
import io
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import httpx
import numpy as np
import pytest
from PIL import Image

from omnistage.testing.toy_video import SPEC, build_toy_video, expected_frames
from omnistage.utils.video import decode_video

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "toy-video"
STEP_DELAY_S = 0.03                    # the toy's step: a slow job is many steps
FAST = {"num_inference_steps": 2}
SLOW = {"num_inference_steps": 200}     # 6 s: long enough to catch, never waited out
MIN_PSNR_DB = 35.0                      # H.264 at CRF 18 on the toy's flat colours: ~45 dB
DEADLINE_S = 60


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_toy_video(tmp_path_factory.mktemp("toy_video"), step_delay_s=STEP_DELAY_S)


def serve_args(toy: tuple[Path, Path], videos_dir: Path, *more: str) -> list[str]:
    return [str(toy[0]), "--stage-config", str(toy[1]), "--served-model-name", MODEL,
            "--videos-dir", str(videos_dir), "--max-video-frames", "17",
            "--max-video-size", "128", *more]


@pytest.fixture(scope="module")
def videos_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("videos")


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], toy: tuple[Path, Path],
           videos_dir: Path) -> Server:
    return start_server(serve_args(toy, videos_dir, "--max-video-jobs", "3",
                                   "--max-media-bytes", "4096"))


def create(server: Server, **body: object) -> dict:
    r = server.post("/v1/videos", json={"model": MODEL, "size": "64x48", **body})
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(server: Server, video_id: str, until: Callable[[dict], bool]) -> dict:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        job = server.get(f"/v1/videos/{video_id}").json()
        if until(job):
            return job
        time.sleep(0.05)
    raise TimeoutError(f"video {video_id}: {job}")


def finished(server: Server, video_id: str) -> dict:
    return wait_for(server, video_id, lambda j: j["status"] not in ("queued", "in_progress"))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255 ** 2 / mse)


def check_video(data: bytes, expected: np.ndarray, fps: float, exact: bool = False) -> None:
    frames, rate = decode_video(data)
    assert frames.shape == expected.shape and rate == pytest.approx(fps, rel=0.05)
    if exact:
        assert np.array_equal(frames, expected)
    else:
        assert psnr(frames, expected) > MIN_PSNR_DB


def delete(server: Server, video_id: str) -> httpx.Response:
    return httpx.delete(f"{server.url}/v1/videos/{video_id}", timeout=30)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), colour).save(buf, "PNG")
    return buf.getvalue()


# ---- jobs ------------------------------------------------------------------------------------

def has_videos_api(server: Server) -> bool:
    """Whether the installed `openai` has client.videos (openai 2.x); older: plain HTTP."""
    return hasattr(server.openai(), "videos")


def test_openai_client_create_retrieve_download(server: Server) -> None:
    client = server.openai()
    if not has_videos_api(server):
        pytest.skip("the installed openai has no client.videos")
    video = client.videos.create(model=MODEL, prompt="a red kite", seconds="1", size="64x48",
                                 extra_body={"seed": 7, **FAST})
    assert video.status == "queued" and video.object == "video" and video.size == "64x48"
    assert video.seconds == "1.125"                # 9 frames (1 + 4k nearest 8) at 8 fps
    deadline = time.monotonic() + DEADLINE_S
    while video.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        video = client.videos.retrieve(video.id)
    assert video.status == "completed" and video.progress == 100 and video.completed_at
    data = client.videos.download_content(video.id).read()
    assert data[4:8] == b"ftyp"
    expected = expected_frames("a red kite", 7, 9, 48, 64)
    check_video(data, expected, SPEC.fps)
    for fmt in ("webm", "gif", "webp"):          # made from the MP4: its loss, no more
        r = server.get(f"/v1/videos/{video.id}/content", params={"format": fmt})
        assert r.status_code == 200, r.text
        check_video(r.content, expected, SPEC.fps)
    thumb = server.get(f"/v1/videos/{video.id}/content", params={"variant": "thumbnail"})
    assert thumb.headers["content-type"] == "image/webp"
    assert psnr(np.asarray(Image.open(io.BytesIO(thumb.content))), expected[0]) > MIN_PSNR_DB


def test_progress_is_reported_while_a_job_runs(server: Server) -> None:
    job = create(server, prompt="slow", seed=1, num_frames=5, num_inference_steps=40)
    seen = wait_for(server, job["id"], lambda j: 0 < j["progress"] < 100)
    assert seen["status"] == "in_progress"
    assert finished(server, job["id"])["status"] == "completed"


def test_image_to_video_as_json_and_as_a_form(server: Server) -> None:
    image = png((200, 40, 90))
    expected = expected_frames("", 3, 5, 48, 64, Image.open(io.BytesIO(image)))
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    by_json = create(server, prompt="x", seed=3, num_frames=5, input_reference=url, **FAST)
    by_form = server.post("/v1/videos", data={"model": MODEL, "prompt": "x", "seed": "3",
                                              "num_frames": "5", "size": "64x48", **FAST},
                          files={"input_reference": ("first.png", image, "image/png")})
    assert by_form.status_code == 200, by_form.text
    for job in (by_json, by_form.json()):
        assert finished(server, job["id"])["status"] == "completed"
        check_video(server.get(f"/v1/videos/{job['id']}/content").content, expected, SPEC.fps)


def test_sync_returns_the_file(server: Server) -> None:
    expected = expected_frames("a boat", 11, 9, 32, 48)
    for fmt, exact in (("webp", True), ("gif", True), ("mp4", False), ("webm", False)):
        r = server.post(f"/v1/videos/sync?format={fmt}",
                        json={"prompt": "a boat", "seed": 11, "size": "48x32", "fps": 12,
                              **FAST})
        assert r.status_code == 200, r.text
        check_video(r.content, expected, 12, exact)


def test_list_pages_through_every_job(server: Server) -> None:
    ids = [create(server, prompt=f"p{i}", seed=i, num_frames=1, **FAST)["id"] for i in range(3)]
    for order in ("asc", "desc"):
        whole = server.get("/v1/videos", params={"limit": 100, "order": order}).json()
        assert not whole["has_more"]
        listed = [v["id"] for v in whole["data"]]
        pos = [listed.index(i) for i in ids]
        assert pos == sorted(pos, reverse=order == "desc")
        paged, after = [], None
        while True:
            page = server.get("/v1/videos", params={"limit": 2, "order": order,
                                                    **({"after": after} if after else {})}
                              ).json()
            paged += [v["id"] for v in page["data"]]
            after = page["last_id"]
            if not page["has_more"]:
                break
        assert paged == listed
        if has_videos_api(server):       # the SDK's pages follow `after` and `has_more`
            assert [v.id for v in server.openai().videos.list(limit=2, order=order)] == listed
    for i in ids:
        finished(server, i)


def test_cancel_and_delete_a_running_job(server: Server) -> None:
    running = create(server, prompt="long", seed=2, num_frames=1, **SLOW)
    wait_for(server, running["id"], lambda j: j["progress"] > 0)
    queued = create(server, prompt="waits", seed=2, num_frames=1, **SLOW)
    cancelled = server.post(f"/v1/videos/{queued['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"
    deleted = delete(server, running["id"]).json()
    assert deleted == {"id": running["id"], "object": "video.deleted", "deleted": True}
    error_of(server.get(f"/v1/videos/{running['id']}"), 404)
    after = create(server, prompt="next", seed=4, num_frames=1, **FAST)   # the engine is free
    assert finished(server, after["id"])["status"] == "completed"
    assert server.get(f"/v1/videos/{queued['id']}").json()["status"] == "cancelled"


def test_a_failing_job_ends_failed_and_the_next_completes(server: Server) -> None:
    bad = create(server, prompt="fail here", seed=1, num_frames=1, **FAST)
    good = create(server, prompt="fine", seed=1, num_frames=1, **FAST)
    failed = finished(server, bad["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "engine_error"
    assert "server's log" in failed["error"]["message"]     # the exception's text stays there
    assert finished(server, good["id"])["status"] == "completed"
    error_of(server.get(f"/v1/videos/{bad['id']}/content"), 400)


# ---- 4xx -------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"num_frames": 21}, "num_frames"),             # over --max-video-frames 17
    ({"seconds": "8"}, "seconds"),                  # 65 frames
    ({"num_frames": 10}, "num_frames"),             # not 1 + 4k
    ({"num_frames": 5, "seconds": "1"}, "num_frames"),
    ({"size": "256x128"}, "size"),                  # over --max-video-size 128
    ({"size": "60x48"}, "size"),                    # not multiples of 16
    ({"size": "big"}, "size"),
    ({"input_reference": "data:image/png;base64,aGVsbG8="}, "input_reference"),
    ({"prompt": ""}, "prompt"),
    ({"colour": "red"}, "colour"),
])
def test_bad_requests_are_400(server: Server, body: dict, param: str) -> None:
    r = server.post("/v1/videos", json={"model": MODEL, "prompt": "a cat", **body})
    assert error_of(r, 400)["param"] == param


def test_an_image_over_the_media_limit_is_413(server: Server) -> None:
    r = server.post("/v1/videos", data={"prompt": "x"},
                    files={"input_reference": ("big.png", b"\0" * 5000, "image/png")})
    assert error_of(r, 413)["code"] == "media_too_large"


def test_models_offer_video(server: Server) -> None:
    caps = server.get(f"/v1/models/{MODEL}").json()["capabilities"]
    assert caps["endpoints"] == ["/v1/videos"], caps


def test_unknown_model_is_404(server: Server) -> None:
    r = server.post("/v1/videos", json={"model": "sora-2", "prompt": "a cat"})
    assert error_of(r, 404)["code"] == "model_not_found"
    error_of(server.get("/v1/videos/video_nope"), 404)


def test_the_job_limit_is_a_429(server: Server) -> None:
    jobs = [create(server, prompt="hold", seed=i, num_frames=1, **SLOW) for i in range(3)]
    r = server.post("/v1/videos", json={"model": MODEL, "prompt": "one too many"})
    assert error_of(r, 429)["code"] == "too_many_video_jobs"
    for job in jobs:
        delete(server, job["id"]).raise_for_status()


def test_the_playground_runs_a_job_to_a_playing_video(server: Server, browser: object) -> None:
    """The video tab in headless Chromium: a job made from the form shows its progress,
    completes, plays in the page (fetched as any client fetches it) and is deleted."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    from omnistage.testing.browser import open_playground, visible_tabs, wait_for

    open_playground(browser, server.url)
    assert visible_tabs(browser) == ["Video"]
    for field, value in (("video-size", "64x48"), ("video-frames", "5"), ("video-steps", "2"),
                         ("video-seed", "4")):
        browser.find_element(By.ID, field).send_keys(value)
    browser.find_element(By.ID, "video-prompt").send_keys("from the page", Keys.ENTER)
    # the list is redrawn as jobs move: elements are found again at each poll
    job_id = wait_for(browser, "the job listed", lambda d: d.execute_script(
        "const li = [...document.querySelectorAll('#video-jobs li')]"
        "  .find(li => li.textContent.startsWith('from the page'));"
        "return li && li.id.slice(4)"))
    wait_for(browser, "the job completed", lambda d: d.find_element(
        By.CSS_SELECTOR, f"#job-{job_id} progress").get_attribute("value") == "100"
        and "completed" in d.find_element(By.ID, f"job-{job_id}").text)
    assert server.get(f"/v1/videos/{job_id}").json()["status"] == "completed"

    def press(label: str) -> None:
        wait_for(browser, f"{label} pressed", lambda d: any(
            b.click() or True for b in d.find_elements(By.CSS_SELECTOR, f"#job-{job_id} button")
            if b.text == label))

    press("Play")
    size = wait_for(browser, "the video playing", lambda d: d.execute_script(
        f"const v = document.querySelector('#job-{job_id} video');"
        "return v && v.readyState >= 2 && [v.videoWidth, v.videoHeight]"))
    assert size == [64, 48]
    press("Delete")
    wait_for(browser, "the job gone", lambda d: not d.find_elements(By.ID, f"job-{job_id}"))
    assert server.get(f"/v1/videos/{job_id}").status_code == 404


# ---- restart (last: it stops the module's server) -------------------------------------------

def test_jobs_survive_a_restart(server: Server, start_server: Callable[..., Server],
                                toy: tuple[Path, Path], videos_dir: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The same server (model, address) started again: its jobs are there (a server at
    another address over the folder sees none: test_video_store.py)."""
    first = server
    done = create(first, prompt="kept", seed=5, num_frames=5, **FAST)
    finished(first, done["id"])
    interrupted = create(first, prompt="cut short", seed=6, num_frames=5,
                         num_inference_steps=60)
    queued = create(first, prompt="waiting", seed=8, num_frames=5, **FAST)
    wait_for(first, interrupted["id"], lambda j: j["progress"] > 0)
    assert first.stop() == 0
    # started again where it listened (the harness gives each server a free port)
    monkeypatch.setattr(sys.modules[type(first).__module__], "free_port", lambda: first.port)
    second = start_server(serve_args(toy, videos_dir, "--max-videos-disk-bytes", "1"))
    listed = {v["id"]: v for v in second.get("/v1/videos").json()["data"]}
    assert listed[done["id"]]["status"] == "completed"
    check_video(second.get(f"/v1/videos/{done['id']}/content").content,
                expected_frames("kept", 5, 5, 48, 64), SPEC.fps)
    for job, prompt, seed in ((interrupted, "cut short", 6), (queued, "waiting", 8)):
        assert finished(second, job["id"])["status"] == "completed"
        check_video(second.get(f"/v1/videos/{job['id']}/content").content,
                    expected_frames(prompt, seed, 5, 48, 64), SPEC.fps)
    r = second.post("/v1/videos", json={"model": MODEL, "prompt": "no room"})
    assert error_of(r, 429)["code"] == "video_storage_full"
