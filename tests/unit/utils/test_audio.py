"""Audio encoding round trips: every format decodes back to the waveform, exactly up to 16-bit
rounding for the lossless ones, and to the same tone and loudness for mp3, opus and aac; streamed pieces join into one file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.utils.audio import FORMATS, AudioEncoder, decode_audio, encode_audio, to_pcm16

RATE = 24000


def tone(freq: float = 440.0, seconds: float = 1.0, rate: int = RATE, amp: float = 0.5
         ) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def peak_hz(wave: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(wave))
    return float(np.fft.rfftfreq(len(wave), 1 / rate)[spectrum.argmax()])


def rms(wave: np.ndarray) -> float:
    return float(np.sqrt(np.mean(wave ** 2)))


@pytest.mark.parametrize("fmt", ["wav", "flac", "pcm16"])
def test_lossless_round_trip(fmt: str) -> None:
    wave = tone()
    out, rate = decode_audio(encode_audio(wave, RATE, fmt), fmt, RATE)
    assert rate == RATE and out.shape == (1, len(wave)) and out.dtype == np.float32
    np.testing.assert_allclose(out[0], wave, atol=1 / 32767 + 1e-6)


@pytest.mark.parametrize("fmt, rate", [("mp3", 24000), ("mp3", 22050), ("opus", 24000),
                                       ("opus", 22050), ("aac", 24000)])
def test_lossy_round_trip_keeps_tone_length_and_loudness(fmt: str, rate: int) -> None:
    wave = tone(rate=rate)
    data = encode_audio(wave, rate, fmt)
    magic = {"mp3": (b"ID3", b"\xff\xfb", b"\xff\xf3"), "opus": (b"OggS",), "aac": (b"\xff\xf1",)}
    assert any(data.startswith(m) for m in magic[fmt])
    out, out_rate = decode_audio(data, fmt)
    mono = out[0]
    # opus decodes at 48 kHz whatever went in; mp3 keeps the rate; both pad a little
    assert out_rate == (48000 if fmt == "opus" else rate)
    assert 0.98 <= len(mono) / out_rate <= 1.15
    assert peak_hz(mono, out_rate) == pytest.approx(440.0, abs=3.0)
    assert rms(mono) == pytest.approx(rms(wave), rel=0.1)


def test_stereo_tensor_and_clipping() -> None:
    left, right = tone(440.0), tone(660.0)
    stereo = torch.from_numpy(np.stack([left, right]))           # (2, N)
    out, _ = decode_audio(encode_audio(stereo, RATE, "wav"), "wav")
    assert out.shape == (2, len(left))
    np.testing.assert_allclose(out, stereo.numpy(), atol=1 / 32767 + 1e-6)
    loud = to_pcm16(np.array([2.0, -2.0, np.nan], dtype=np.float32))
    assert np.frombuffer(loud, "<i2").tolist() == [32767, -32767, 0]
    mp3, _ = decode_audio(encode_audio(stereo, RATE, "mp3"), "mp3")
    assert mp3.shape[0] == 2


@pytest.mark.parametrize("args, match", [
    ((tone(), RATE, "aiff"), "aiff"),
    ((tone(), 0, "wav"), "sample_rate"),
    ((np.zeros((2, 3, 4), np.float32), RATE, "wav"), "shape"),
])
def test_bad_arguments_raise(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_audio(*args)


def test_undecodable_bytes_raise_value_error() -> None:
    with pytest.raises(ValueError, match="decode"):
        decode_audio(b"certainly not audio")
    with pytest.raises(ValueError, match="sample rate"):
        decode_audio(b"\x00\x01", "pcm16")
    assert set(FORMATS) == {"wav", "pcm16", "flac", "mp3", "opus", "aac"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_streamed_pieces_join_into_one_file(fmt: str) -> None:
    """Chunks encoded as they come, pieces joined: one file that decodes to the whole tone
    (exactly for the lossless formats, wav's header saying "length unknown")."""
    wave = tone(seconds=0.5)
    enc = AudioEncoder(fmt, RATE)
    data = b"".join([*(enc.encode(c) for c in np.array_split(wave, 5)), enc.close()])
    out, out_rate = decode_audio(data, fmt, RATE)
    if fmt in ("wav", "flac", "pcm16"):
        assert out_rate == RATE and out.shape == (1, len(wave))
        np.testing.assert_allclose(out[0], wave, atol=1 / 32767 + 1e-6)
    else:
        assert 0.49 <= out.shape[1] / out_rate <= 0.6
        assert peak_hz(out[0], out_rate) == pytest.approx(440.0, abs=6.0)
