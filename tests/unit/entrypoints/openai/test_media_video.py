"""Video parts beyond 2 fps sampling: vLLM's `video_url.num_frames` (that many frames spread
evenly, bounded by --max-input-video-frames) and the audio track of a video
(`use_audio_in_video`), and the refusal of remote media naming the flag."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.media import MediaBudget, MediaLoader, MediaPolicy
from tests.helpers.audio_in_video import mp4_with_audio


def url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def grey(frame) -> int:
    """The grey level 10 * i that mp4_with_audio drew into frame i (lossy: rounded)."""
    return round(float(np.asarray(frame.convert("L")).mean()) / 10)


def test_num_frames_spreads_frames_evenly() -> None:
    loader = MediaLoader(MediaPolicy())
    clip = loader.video_clip(url(mp4_with_audio(20, fps=10, audio_seconds=None)), "p",
                             num_frames=4)
    # transformers' sample_frames: floor(k * 20 / 4) = 0, 5, 10, 15; the 4 frames span 2 s
    assert [grey(f) for f in clip.frames] == [0, 5, 10, 15]
    assert clip.fps == pytest.approx(2.0) and clip.audio is None
    more = loader.video_clip(url(mp4_with_audio(6, fps=10, audio_seconds=None)), "p",
                             num_frames=16)
    assert len(more.frames) == 6 and more.fps == pytest.approx(10.0)   # every frame there is
    plain = loader.video_clip(url(mp4_with_audio(20, fps=10, audio_seconds=None)), "p")
    assert len(plain.frames) == 4 and plain.fps == 2.0                  # 2 fps as before


@pytest.mark.parametrize("num_frames", [0, 9])
def test_num_frames_is_bounded(num_frames: int) -> None:
    loader = MediaLoader(MediaPolicy(max_video_frames=8))
    with pytest.raises(APIError) as err:
        loader.video_clip(url(mp4_with_audio(4, audio_seconds=None)), "p",
                          num_frames=num_frames)
    assert err.value.status == 400 and err.value.param == "p"
    assert "--max-input-video-frames" in err.value.message


def test_num_frames_charges_the_pixel_budget() -> None:
    policy = MediaPolicy(max_request_pixels=32 * 16 * 3)
    with pytest.raises(APIError) as err:
        MediaLoader(policy).video_clip(url(mp4_with_audio(20, audio_seconds=None)), "p",
                                       MediaBudget(policy), num_frames=4)
    assert err.value.code == "media_too_large"


def test_the_audio_track_comes_with_the_frames() -> None:
    loader = MediaLoader(MediaPolicy())
    clip = loader.video_clip(url(mp4_with_audio(20, fps=10, audio_seconds=2.0, rate=16000)),
                             "p", with_audio=True)
    wave, rate = clip.audio
    assert rate == 16000 and wave.ndim == 1 and wave.dtype == np.float32
    assert abs(wave.size - 32000) < 2048              # the encoder's priming and padding
    spectrum = np.abs(np.fft.rfft(wave[4000:20000]))
    assert abs(np.argmax(spectrum) * rate / 16000 - 440) < 5            # the 440 Hz tone
    silent = loader.video_clip(url(mp4_with_audio(20, audio_seconds=None)), "p",
                               with_audio=True)
    assert silent.audio is None                       # no track: the video alone (as HF)


def test_the_audio_track_is_charged_to_the_request() -> None:
    policy = MediaPolicy(max_audio_seconds=1.0)
    with pytest.raises(APIError) as err:
        MediaLoader(policy).video_clip(url(mp4_with_audio(20, audio_seconds=2.0)), "p",
                                       MediaBudget(policy), with_audio=True)
    assert err.value.code == "audio_too_long" and "--max-audio-seconds" in err.value.message


def test_remote_media_refusal_names_the_flags() -> None:
    with pytest.raises(APIError) as err:
        MediaLoader(MediaPolicy()).fetch("https://example.com/v.mp4", "p")
    assert err.value.status == 400 and err.value.code == "media_not_allowed"
    assert "--allow-remote-media" in err.value.message
    assert "--api-dialect vllm-omni" in err.value.message


def test_remote_media_follows_the_dialect() -> None:
    """vLLM fetches media URLs by default: a server answering as vLLM-Omni does too (public
    addresses only); --allow-remote-media turns it on anywhere."""
    from omnistage.entrypoints.openai.api_server import ServerConfig

    assert not ServerConfig().media_policy.allow_remote
    assert ServerConfig(api_dialect="vllm-omni").media_policy.allow_remote
    assert ServerConfig(vllm_omni_launch=True).media_policy.allow_remote        # --omni
    assert not ServerConfig(vllm_omni_launch=True, api_dialect="openai").media_policy.allow_remote
    assert ServerConfig(allow_remote_media=True, api_dialect="openai").media_policy.allow_remote
