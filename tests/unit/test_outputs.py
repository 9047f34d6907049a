"""OmniOutput: its completions (n), its short repr, its audio (the waveform as numpy,
streaming deltas, save_audio round trips through every format, decoded back and compared)."""

from __future__ import annotations

import re
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from omnistage.errors import StageError
from omnistage.outputs import CompletionOutput, OmniOutput, RequestEvent, StageMetrics
from omnistage.utils.audio import decode_audio

RATE = 24000
NUM_SAMPLES = 24001      # odd: no format may pad or cut to an even or frame-sized length


def tone(num_samples: int = NUM_SAMPLES, rate: int = RATE) -> torch.Tensor:
    t = torch.arange(num_samples, dtype=torch.float64) / rate
    return (0.5 * torch.sin(2 * torch.pi * 440 * t)).float()


def finished(tensors: dict[str, torch.Tensor], sample_rate: int | None = RATE) -> OmniOutput:
    done = CompletionOutput(text="hello", finished=True, finish_reason="stop", tensors=tensors)
    return OmniOutput("req-1", "hi", [1, 2], [done], finished=True, sample_rate=sample_rate)


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
    streaming = OmniOutput("req-1", "hi", [1], [CompletionOutput(
        delta_tensors={"audio": tone(100)})], sample_rate=RATE)
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
    snaps = [out.apply(ev) for ev in events]
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
    snap = out.apply(RequestEvent("req-1", "vocoder", tensors={
        "audio": tone(160, 16000), "sample_rate": torch.tensor([16000])}))
    assert snap.sample_rate == out.sample_rate == 16000


def test_n_completions_fold_into_one_output() -> None:
    """Events of completion i land in outputs[i]; the request finishes when every completion
    has; the first completion's fields are the request's own (what n=1 reads)."""
    out = OmniOutput("req-1", "hi", [1], [CompletionOutput(index=i) for i in range(2)])
    events = [RequestEvent("req-1", "llm", [5], "a", index=1),
              RequestEvent("req-1", "llm", [6], "b", index=0),
              RequestEvent("req-1", "llm", [7], "c", index=1, stage_finished=True,
                            finish_reason="length", done=True,
                            stage_metrics={"llm": StageMetrics(num_cached_tokens=1)}),
              RequestEvent("req-1", "llm", [8], "d", index=0, stage_finished=True,
                            finish_reason="stop", done=True,
                            stage_metrics={"llm": StageMetrics(num_cached_tokens=0)})]
    snaps = [out.apply(ev) for ev in events]
    assert [s.index for s in snaps] == [1, 0, 1, 0]
    assert snaps[0].outputs[1].delta_text == "a" and snaps[0].delta_text == ""  # not the 1st
    assert snaps[1].delta_text == "b" and snaps[1].outputs[1].delta_text == ""
    assert snaps[2].outputs[1].finished and not snaps[2].finished
    assert snaps[3].finished and out.finished
    assert [c.text for c in out.outputs] == ["bd", "ac"] and out.text == "bd"
    assert [c.token_ids for c in out.outputs] == [[6, 8], [5, 7]] and out.token_ids == [6, 8]
    assert [c.finish_reason for c in out.outputs] == ["stop", "length"]
    assert out.finish_reason == "stop"
    assert out.metrics.num_output_tokens == 4 and out.metrics.num_cached_tokens == 1
    assert snaps[0].outputs[1].text == "a"        # a snapshot keeps what it had


def test_a_failed_completion_fails_the_request() -> None:
    out = OmniOutput("req-1", "hi", [1], [CompletionOutput(index=i) for i in range(2)])
    err = StageError("llm", "internal", "boom")
    out.apply(RequestEvent("req-1", "llm", done=True, index=1, finish_reason="error", error=err))
    assert out.error == err and str(out.error) == "stage 'llm': boom"
    assert out.outputs[1].finish_reason == "error" and not out.invalid_input
    assert not out.finished and out.finish_reason is None
    out.apply(RequestEvent("req-1", "", done=True, finish_reason="abort"))
    assert out.finished and out.finish_reason == "abort"


def test_repr_is_short() -> None:
    """Request id, finished, the text's first 60 characters, tensor shapes, never values."""
    long_text = "word " * 40
    c = CompletionOutput(text=long_text, token_ids=list(range(40)), finished=True,
                         finish_reason="length", sample_rate=RATE,
                         tensors={"audio": tone(), "sample_rate": torch.tensor([RATE]),
                                  "images": torch.zeros(2, 8, 8, 3, dtype=torch.uint8)})
    out = OmniOutput("req-7", "hi", [1], [c, CompletionOutput(index=1)], finished=True)
    text = repr(out)
    assert text.startswith("OmniOutput(request_id='req-7', finished=True, ")
    assert repr(long_text[:60]) in text and "(200 chars)" in text and long_text not in text
    assert "audio=(24001,) float32 @ 24000 Hz" in text and "images=(2, 8, 8, 3) uint8" in text
    assert "token_ids=[40 ids]" in text and "n=2" in text and len(text) < 400
    assert "tensor(" not in text and "sample_rate=" not in text
    assert repr(out.outputs[1]) == ("CompletionOutput(index=1, finish_reason=None, text='', "
                                    "token_ids=[0 ids])")
    streaming = OmniOutput("req-8", None, [], [CompletionOutput(
        text="ab", delta_text="b", delta_tensors={"audio": tone(100)})])
    assert "delta_text='b'" in repr(streaming) and "delta_audio=(100,)" in repr(streaming)


def _format(path: Path) -> tuple[str, str]:
    """(container, decoder) names as FFmpeg reads the file."""
    with av.open(str(path)) as container:
        return container.format.name, container.streams.audio[0].codec_context.name


def test_video_and_save_video(tmp_path: Path) -> None:
    """The final video's frames as numpy; save_video writes the format its extension names
    (WebP: lossless, so the frames come back equal); no video, or an unknown extension, is
    a ValueError."""
    from omnistage.utils.video import decode_video

    frames = torch.zeros(1, 3, 16, 16, 3, dtype=torch.uint8)
    for i in range(3):
        frames[0, i, :, 4 * i:4 * i + 4] = 200
    out = finished({"video": frames})
    assert np.array_equal(out.video, frames[0].numpy())
    out.save_video(tmp_path / "v.webp", fps=8)
    got, fps = decode_video((tmp_path / "v.webp").read_bytes())
    assert np.array_equal(got, frames[0].numpy()) and fps == pytest.approx(8)
    with pytest.raises(ValueError, match="extension"):
        out.save_video(tmp_path / "v.avi", fps=8)
    with pytest.raises(ValueError, match="no video"):
        finished({"audio": tone()}).save_video(tmp_path / "v.mp4", fps=8)
