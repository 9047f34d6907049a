"""LTX-2 through /v1/videos: a server on a tiny random LTX-2 folder (tests/helpers/ltx2.py,
with a tiny Gemma 3 text encoder) answers the sync route with an MP4 whose audio stream is
the vocoder's waveform: stereo, at the vocoder's rate, about as long as the clip, audible;
`variant=audio` answers the same track as WAV."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytest
import soundfile

from omnistage.utils.video import decode_sound_track, decode_video

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

pytest.importorskip("diffusers")

BODY = {"prompt": "a dog barks in the rain", "seed": 3, "size": "64x32", "num_frames": 9,
        "fps": 12, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def ltx2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.ltx2 import build_tiny_ltx2
    from tests.helpers.ltx2_text import add_tiny_text_encoder

    path = tmp_path_factory.mktemp("tiny_ltx2")
    build_tiny_ltx2(path)
    add_tiny_text_encoder(path)
    return path


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], ltx2: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Server:
    return start_server([str(ltx2), "--served-model-name", "tiny-ltx2", "--videos-dir",
                         str(tmp_path_factory.mktemp("videos")), "--max-video-size", "128"])


def test_the_mp4_carries_ltx2s_sound_track(server: Server, ltx2: Path) -> None:
    r = server.post("/v1/videos/sync", json=BODY)
    assert r.status_code == 200, r.text
    frames, fps = decode_video(r.content)
    assert frames.shape == (BODY["num_frames"], 32, 64, 3) and fps == pytest.approx(12)
    track = decode_sound_track(r.content)
    assert track is not None, "LTX-2's MP4 has no audio stream"
    rate = json.loads((ltx2 / "vocoder" / "config.json").read_text())["output_sampling_rate"]
    assert track.sample_rate == rate and track.samples.shape[0] == 2
    seconds = BODY["num_frames"] / BODY["fps"]
    assert track.seconds == pytest.approx(seconds, rel=0.25)
    assert np.abs(track.samples).mean() > 0.01                # not silence


def test_variant_audio_is_the_same_track_as_wav(server: Server) -> None:
    mp4 = server.post("/v1/videos/sync", json=BODY)
    wav = server.post("/v1/videos/sync?variant=audio", json=BODY)
    assert wav.status_code == 200 and wav.headers["content-type"] == "audio/wav", wav.text
    samples, rate = soundfile.read(io.BytesIO(wav.content), dtype="float32")
    track = decode_sound_track(mp4.content)
    assert track is not None and rate == track.sample_rate
    assert samples.T.shape == track.samples.shape
    n = samples.shape[0]
    corr = [float(np.corrcoef(samples[:, c], track.samples[c, :n])[0, 1]) for c in range(2)]
    assert min(corr) > 0.9                   # AAC of the same waveform (~0.98)
