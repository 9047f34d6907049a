"""A video's sound track (utils/video.py): MP4 muxes it as AAC at its own rate, WebM as Opus at
48 kHz, both read back (`decode_sound_track`) at the clip's length with the samples that went
in; WebP and GIF leave it out; a file without one has none; bad tracks are refused."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage.utils.audio import resample
from omnistage.utils.video import SoundTrack, decode_sound_track, decode_video, encode_video

FPS = 24.0
FRAMES = np.random.default_rng(0).integers(0, 255, (9, 32, 48, 3), dtype=np.uint8)


def tone(rate: int, channels: int = 2) -> np.ndarray:
    t = np.arange(round(len(FRAMES) / FPS * rate)) / rate
    waves = [0.5 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 660 * t + 1)]
    return np.stack(waves[:channels]).astype(np.float32)


def correlation(got: np.ndarray, want: np.ndarray) -> float:
    n = min(got.shape[1], want.shape[1])
    return min(float(np.corrcoef(g[:n], w[:n])[0, 1]) for g, w in zip(got, want))


@pytest.mark.parametrize("rate,channels", [(24000, 2), (16000, 1)])
def test_mp4_carries_the_track_as_aac(rate: int, channels: int) -> None:
    wave = tone(rate, channels)
    data = encode_video(FRAMES, FPS, "mp4", SoundTrack(wave, rate))
    frames, fps = decode_video(data)
    assert frames.shape == FRAMES.shape and fps == pytest.approx(FPS)
    track = decode_sound_track(data)
    assert track is not None and track.sample_rate == rate
    assert track.samples.shape == wave.shape          # the encoder's priming and padding cut
    assert correlation(track.samples, wave) > 0.99


def test_webm_carries_the_track_as_opus() -> None:
    wave = tone(24000)
    track = decode_sound_track(encode_video(FRAMES, FPS, "webm", SoundTrack(wave, 24000)))
    assert track is not None and track.sample_rate == 48000     # Opus' rate
    want = np.stack([resample(w, 24000, 48000) for w in wave])
    assert abs(track.samples.shape[1] - want.shape[1]) <= 480
    assert correlation(track.samples, want) > 0.95


@pytest.mark.parametrize("fmt", ["webp", "gif"])
def test_formats_without_sound_leave_it_out(fmt: str) -> None:
    data = encode_video(FRAMES, FPS, fmt, SoundTrack(tone(24000), 24000))  # type: ignore[arg-type]
    assert decode_sound_track(data) is None
    assert decode_video(data)[0].shape == FRAMES.shape


def test_a_silent_video_has_no_track() -> None:
    assert decode_sound_track(encode_video(FRAMES, FPS, "mp4")) is None


def test_bad_tracks_are_refused() -> None:
    with pytest.raises(ValueError, match="sample_rate"):
        SoundTrack(tone(24000), 0)
    with pytest.raises(ValueError, match="channels"):
        SoundTrack(np.zeros((3, 100), np.float32), 24000)
    with pytest.raises(ValueError, match="channels"):
        SoundTrack(np.zeros((2, 0), np.float32), 24000)
