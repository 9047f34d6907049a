"""/v1/videos with a sound track, through a real server serving the toy video model with
sound (omnistage/testing/toy_video_audio.py: frames and a stereo waveform known from the
prompt and the seed, returned as LTX-2's pipeline returns them): the job's MP4 and the sync
MP4 carry an AAC stream (read back with PyAV: its rate, its length, samples correlating with
what the model made), variant=audio serves the track alone as WAV, WebM keeps it as Opus,
generate_sound false leaves it out; and the toy without sound refuses what asks for sound
(400 naming the field)."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytest
import soundfile

from omnistage.testing.toy_video import build_toy_video
from omnistage.testing.toy_video_audio import (SAMPLE_RATE, build_toy_video_audio,
                                               expected_sound)
from omnistage.utils.audio import resample
from omnistage.utils.video import decode_sound_track, decode_video

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "toy-video-audio"
FAST = {"num_inference_steps": 2}
BODY = {"prompt": "a drum", "seed": 7, "size": "48x32", "fps": 8, "num_frames": 13, **FAST}
DEADLINE_S = 60


def serve_args(folder: tuple[Path, Path], videos_dir: Path, name: str) -> list[str]:
    return [str(folder[0]), "--stage-config", str(folder[1]), "--served-model-name", name,
            "--videos-dir", str(videos_dir), "--max-video-frames", "17",
            "--max-video-size", "128"]


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
           ) -> Server:
    folder = build_toy_video_audio(tmp_path_factory.mktemp("toy_video_audio"))
    return start_server(serve_args(folder, tmp_path_factory.mktemp("videos"), MODEL))


def expected() -> np.ndarray:
    return expected_sound(BODY["seed"], BODY["num_frames"], BODY["fps"])   # (2, 26000)


def correlation(got: np.ndarray, want: np.ndarray) -> list[float]:
    n = min(got.shape[1], want.shape[1])
    return [float(np.corrcoef(got[c, :n], want[c, :n])[0, 1]) for c in range(want.shape[0])]


def check_track(data: bytes, rate: int = SAMPLE_RATE) -> None:
    """The file's audio stream: its rate, its length (the clip's), its samples."""
    frames, _ = decode_video(data)
    assert frames.shape == (BODY["num_frames"], 32, 48, 3)
    track = decode_sound_track(data)
    assert track is not None, "the file has no audio stream"
    want = expected()
    if rate != SAMPLE_RATE:                      # Opus: 48 kHz
        want = np.stack([resample(w, SAMPLE_RATE, rate) for w in want])
    assert track.sample_rate == rate and track.samples.shape[0] == 2
    assert abs(track.samples.shape[1] - want.shape[1]) <= rate // 100   # within 10 ms
    assert min(correlation(track.samples, want)) > 0.95
    assert 0.1 < np.abs(track.samples).mean() < 0.5


def finished(server: Server, video_id: str) -> dict:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        job = server.get(f"/v1/videos/{video_id}").json()
        if job["status"] not in ("queued", "in_progress"):
            return job
        time.sleep(0.05)
    raise TimeoutError(f"video {video_id}: {job}")


def error_of(r: object, status: int) -> dict:
    assert r.status_code == status, r.text           # type: ignore[attr-defined]
    return r.json()["error"]                         # type: ignore[attr-defined]


def test_a_job_mp4_carries_the_sound_and_serves_it_alone(server: Server) -> None:
    r = server.post("/v1/videos", json={"model": MODEL, **BODY})
    assert r.status_code == 200, r.text
    job = finished(server, r.json()["id"])
    assert job["status"] == "completed", job
    check_track(server.get(f"/v1/videos/{job['id']}/content").content)
    wav = server.get(f"/v1/videos/{job['id']}/content?variant=audio")
    assert wav.status_code == 200 and wav.headers["content-type"] == "audio/wav"
    samples, rate = soundfile.read(io.BytesIO(wav.content), dtype="float32")
    assert rate == SAMPLE_RATE and samples.T.shape == expected().shape
    assert np.abs(samples.T - expected()).max() < 1e-4 + 1 / 32767     # 16-bit PCM
    check_track(server.get(f"/v1/videos/{job['id']}/content?format=webm").content, 48000)


def test_sync_answers_the_mp4_or_the_sound(server: Server) -> None:
    r = server.post("/v1/videos/sync", json=BODY)
    assert r.status_code == 200, r.text
    check_track(r.content)
    r = server.post("/v1/videos/sync?variant=audio", json=BODY)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    samples, rate = soundfile.read(io.BytesIO(r.content), dtype="float32")
    assert rate == SAMPLE_RATE and min(correlation(samples.T, expected())) > 0.999


def test_generate_sound_false_leaves_the_track_out(server: Server) -> None:
    r = server.post("/v1/videos/sync", json={**BODY, "generate_sound": False})
    assert r.status_code == 200, r.text
    assert decode_sound_track(r.content) is None
    r = server.post("/v1/videos", json={"model": MODEL, **BODY, "generate_sound": False})
    job = finished(server, r.json()["id"])
    err = error_of(server.get(f"/v1/videos/{job['id']}/content?variant=audio"), 400)
    assert err["param"] == "variant"


def test_a_model_without_sound_refuses_sound(start_server: Callable[..., Server],
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = build_toy_video(tmp_path_factory.mktemp("toy_video"))
    silent = start_server(serve_args(folder, tmp_path_factory.mktemp("videos_silent"), "toy"))
    body = {k: v for k, v in BODY.items() if k != "num_frames"}
    err = error_of(silent.post("/v1/videos", json={**body, "generate_sound": True}), 400)
    assert err["param"] == "generate_sound"
    err = error_of(silent.post("/v1/videos/sync?variant=audio", json=body), 400)
    assert err["param"] == "variant"
    r = silent.post("/v1/videos/sync", json=body)
    assert r.status_code == 200 and decode_sound_track(r.content) is None
