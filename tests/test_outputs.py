"""OmniOutput's audio: the waveform as numpy, streaming deltas, and save_audio round trips
through every format (decoded back and compared with what was saved)."""

from __future__ import annotations

import re
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from omnistage.engine.async_omni import accumulate
from omnistage.outputs import OmniOutput, RequestEvent
from omnistage.utils.audio import decode_audio

RATE = 24000
NUM_SAMPLES = 24001      # odd: no format may pad or cut to an even or frame-sized length


def tone(num_samples: int = NUM_SAMPLES, rate: int = RATE) -> torch.Tensor:
    t = torch.arange(num_samples, dtype=torch.float64) / rate
    return (0.5 * torch.sin(2 * torch.pi * 440 * t)).float()


def finished(tensors: dict[str, torch.Tensor], sample_rate: int | None = RATE) -> OmniOutput:
    return OmniOutput("req-1", "hi", [1, 2], text="hello", finished=True, finish_reason="stop",
                      tensors=tensors, sample_rate=sample_rate)


def test_audio_is_the_final_tensor_as_float32_numpy() -> None:
    wave = tone()
    out = finished({"audio": wave})
    audio = out.audio
    assert isinstance(audio, np.ndarray) and audio.dtype == np.float32
    assert audio.shape == (NUM_SAMPLES,) and np.array_equal(audio, wave.numpy())
    assert out.tensors["audio"] is wave and out.sample_rate == RATE   # the tensor as before
    assert out.delta_audio is None


def test_no_audio() -> None:
    out = finished({}, sample_rate=None)
    assert out.audio is None and out.delta_audio is None and out.sample_rate is None


@pytest.mark.parametrize("name, container, codec", [("answer.wav", "wav", "pcm_s16le"),
                                                    ("answer.flac", "flac", "flac"),
                                                    ("ANSWER.WAV", "wav", "pcm_s16le")])
def test_save_lossless_formats_round_trip(tmp_path: Path, name: str, container: str,
                                          codec: str) -> None:
    wave = tone()
    path = tmp_path / name
    finished({"audio": wave}).save_audio(path)
    assert _format(path) == (container, codec)
    back, rate = decode_audio(path.read_bytes())
    assert rate == RATE and back.shape == (1, NUM_SAMPLES)
    assert np.abs(back[0] - wave.numpy()).max() <= 1e-4        # 16-bit PCM rounding


@pytest.mark.parametrize("name, container, codec, frame_s", [
    ("answer.mp3", "mp3", "mp3", 1152 / RATE),     # an MPEG-2 layer III frame at 24 kHz
    ("answer.ogg", "ogg", "opus", 0.02),           # Opus frames are 20 ms
    ("answer.opus", "ogg", "opus", 0.02),
    (str(Path("sub.dir") / "answer.Opus"), "ogg", "opus", 0.02),
])
def test_save_lossy_formats_round_trip(tmp_path: Path, name: str, container: str, codec: str,
                                       frame_s: float) -> None:
    wave = tone().numpy()
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    str_path = str(path)                     # a str works as well as a Path
    finished({"audio": torch.from_numpy(wave)}).save_audio(str_path)
    found_container, found_codec = _format(path)
    assert found_container == container and codec in found_codec   # the decoder: mp3float, ...
    back, rate = decode_audio(path.read_bytes())             # Opus decodes at 48 kHz
    assert abs(back.shape[1] / rate - NUM_SAMPLES / RATE) <= frame_s
    # back onto the original's sample times; a delay or a wrong rate would decorrelate a tone
    resampled = np.interp(np.arange(NUM_SAMPLES) / RATE, np.arange(back.shape[1]) / rate,
                          back[0])
    assert np.corrcoef(resampled, wave)[0, 1] > 0.9
    assert 0.4 < np.abs(resampled).max() < 0.6               # the amplitude survived


@pytest.mark.parametrize("name", ["answer.aac", "answer", "answer.wav.txt"])
def test_save_audio_unknown_extension(tmp_path: Path, name: str) -> None:
    suffix = Path(name).suffix or "(none)"
    with pytest.raises(ValueError, match=rf"unknown extension '{re.escape(suffix)}'.*"
                                         r"\.wav, \.flac, \.mp3, \.ogg, \.opus"):
        finished({"audio": tone()}).save_audio(tmp_path / name)
    assert not (tmp_path / name).exists()


def test_save_audio_without_audio(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="produced no audio.*text only"):
        finished({}, sample_rate=None).save_audio(tmp_path / "answer.wav")
    streaming = OmniOutput("req-1", "hi", [1], delta_tensors={"audio": tone(100)},
                           sample_rate=RATE)
    with pytest.raises(ValueError, match="has not finished.*delta_audio"):
        streaming.save_audio(tmp_path / "answer.wav")
    with pytest.raises(ValueError, match="sample rate .* unknown"):
        finished({"audio": tone()}, sample_rate=None).save_audio(tmp_path / "answer.wav")
    assert not list(tmp_path.iterdir())


def test_streaming_snapshots_carry_the_samples_they_added() -> None:
    wave = tone()
    chunks = list(wave.split([7001, 12000, 5000]))
    out = OmniOutput("req-1", "hi", [1, 2], sample_rate=RATE)
    events = [RequestEvent("req-1", "thinker", [5], "he"),
              *(RequestEvent("req-1", "code2wav", tensors={"audio": c}) for c in chunks),
              RequestEvent("req-1", "code2wav", done=True, finish_reason="stop")]
    snaps = [accumulate(out, ev) for ev in events]
    assert snaps[0].delta_audio is None and snaps[0].audio is None
    for snap, chunk in zip(snaps[1:4], chunks):
        assert snap.delta_audio.dtype == np.float32
        assert np.array_equal(snap.delta_audio, chunk.numpy())   # after later updates, too
        assert snap.audio is None                                # final audio: once finished
    assert snaps[-1].delta_audio is None and snaps[-1].finished
    assert np.array_equal(snaps[-1].audio, wave.numpy())
    assert np.array_equal(np.concatenate([s.delta_audio for s in snaps[1:4]]), snaps[-1].audio)
    assert all(s.sample_rate == RATE for s in snaps)


def test_a_rate_sent_with_the_samples_wins() -> None:
    out = OmniOutput("req-1", None, [1], sample_rate=RATE)
    snap = accumulate(out, RequestEvent("req-1", "vocoder", tensors={
        "audio": tone(160, 16000), "sample_rate": torch.tensor([16000])}))
    assert snap.sample_rate == out.sample_rate == 16000


def _format(path: Path) -> tuple[str, str]:
    """(container, decoder) names as FFmpeg reads the file."""
    with av.open(str(path)) as container:
        return container.format.name, container.streams.audio[0].codec_context.name
