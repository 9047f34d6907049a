"""Frames to video files and back: every format decodes to the frames it was given, exactly
where the format is lossless (WebP; GIF for frames of few colours), within a PSNR bound where
it is not (MP4, WebM); the frame count and rate survive; bad frames are refused."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage.utils.video import (FORMATS, decode_video, encode_video, mp4_codec, sniff_format,
                                   webm_codec)

MIN_PSNR_DB = 35.0      # x264 CRF 18 / VP9 CRF 24 on smooth frames: ~40-45 dB


def smooth_frames(num_frames: int = 9, height: int = 48, width: int = 64) -> np.ndarray:
    """A gradient drifting right a few pixels a frame: every frame differs."""
    y, x = np.mgrid[:height, :width].astype(np.float64)
    frames = [np.stack([(x + 3 * i) * 3, y * 4, 128 + 60 * np.sin((x + y + 2 * i) / 9)], -1)
              for i in range(num_frames)]
    return np.clip(frames, 0, 255).astype(np.uint8)


def few_colours(num_frames: int = 6) -> np.ndarray:
    frames = np.zeros((num_frames, 32, 48, 3), np.uint8)
    frames[:] = (20, 90, 200)
    for i in range(num_frames):
        frames[i, 8:20, 4 * i:4 * i + 10] = (250, 200, 10)
    return frames


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255 ** 2 / mse)


def test_codecs_are_the_widely_playable_ones() -> None:
    assert mp4_codec() in ("libx264", "h264", "libopenh264", "mpeg4")
    assert webm_codec() in ("libvpx-vp9", "libvpx")


@pytest.mark.parametrize("fmt", ["mp4", "webm"])
def test_lossy_formats_within_psnr(fmt: str) -> None:
    frames = smooth_frames()
    data = encode_video(frames, 16, fmt)
    assert sniff_format(data) == fmt
    got, fps = decode_video(data)
    assert got.shape == frames.shape and fps == pytest.approx(16)
    assert psnr(got, frames) > MIN_PSNR_DB
    assert psnr(got, frames[::-1]) < MIN_PSNR_DB - 10      # a wrong frame order would fail


def test_webp_is_lossless() -> None:
    frames = smooth_frames()
    got, fps = decode_video(encode_video(frames, 10, "webp"))
    assert np.array_equal(got, frames) and fps == pytest.approx(10)


def test_gif_is_exact_for_few_colours() -> None:
    frames = few_colours()
    got, fps = decode_video(encode_video(frames, 10, "gif"))
    assert np.array_equal(got, frames) and fps == pytest.approx(10)


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_frame(fmt: str) -> None:
    frames = few_colours(1)
    got, _ = decode_video(encode_video(frames, 8, fmt))
    assert got.shape == frames.shape


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="even"):
        encode_video(np.zeros((2, 31, 32, 3), np.uint8), 8, "mp4")
    with pytest.raises(ValueError, match="uint8"):
        encode_video(np.zeros((2, 32, 32, 3), np.float32), 8, "webm")
    with pytest.raises(ValueError, match="fps"):
        encode_video(few_colours(), 0, "gif")
    with pytest.raises(ValueError, match="format"):
        encode_video(few_colours(), 8, "avi")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        sniff_format(b"not a video file")
