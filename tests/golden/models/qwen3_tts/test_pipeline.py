"""Qwen3-TTS end to end on the stage runtime (talker on the AR engine -> code2wav as a
generation stage, configs/qwen3_tts.yaml) against the `qwen-tts` reference, greedy, float32:
`Omni(model=<folder>).generate(text, SamplingParams(extra={voice...}))` gives the reference's
waveform in `.audio` at its `.sample_rate`, streamed in chunks."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
import soundfile
import torch

from omnistage import AsyncOmni, Omni, SamplingParams
from omnistage.entrypoints.cli.main import main
from omnistage.testing.tiny_tts import CASES, CLIPS, MAX_TOKENS

WAV_ATOL = 1e-4


def greedy(**extra: object) -> SamplingParams:
    """The reference's talker with do_sample=False (its repetition penalty and 2-frame
    minimum kept)."""
    return SamplingParams(temperature=0.0, repetition_penalty=1.05, min_tokens=2,
                          max_tokens=MAX_TOKENS, detokenize=False, extra=extra)


def voice(name: str) -> dict:
    """A golden case's voice as the talker stage's `extra` takes it."""
    fields = CASES[name][1]
    extra = {"language": fields["language"]}
    if fields.get("speaker"):
        extra["voice"] = fields["speaker"]
    if fields.get("instruct"):
        extra["instructions"] = fields["instruct"]
    if name in CLIPS:
        extra["ref_audio"] = CLIPS[name].tolist()
        if fields.get("ref_text"):
            extra["ref_text"] = fields["ref_text"]
    return extra


def engine(root: Path, mode: str) -> Omni:
    # small code2wav chunks, a short first one: the audio crosses several seams
    return Omni(str(root / mode), device="cpu", backend="inproc", connector="inproc",
                stage_overrides=["code2wav.generation.options.chunk_frames=4",
                                 "code2wav.generation.options.first_chunk_frames=3"])


@pytest.mark.parametrize("name", ["preset", "design", "icl"])
def test_audio_equals_reference(name: str, ref: dict) -> None:
    mode, fields = CASES[name]
    with engine(ref["root"], mode) as omni:
        (out,) = omni.generate(fields["text"], greedy(**voice(name)))
    assert out.error is None, out.error
    expected = torch.from_numpy(ref[name]["wav0"])
    assert out.sample_rate == 24000
    # the reference cuts a clone's reference audio at int(prefix / frames * samples)
    assert 0 <= expected.shape[0] - out.tensors["audio"].shape[0] <= 1, (expected.shape, out.tensors["audio"].shape)
    torch.testing.assert_close(out.tensors["audio"], expected[-out.tensors["audio"].shape[0]:], atol=WAV_ATOL, rtol=0)


def test_requests_together_equal_alone(ref: dict) -> None:
    """Different texts of one voice in one batch (talker and vocoder): each as alone."""
    texts = [CASES["preset"][1]["text"], "The quick brown fox jumps over the lazy dog.", "Hi."]
    params = greedy(**voice("preset"))
    with engine(ref["root"], "custom_voice") as omni:
        both = omni.generate(texts, params)
        alone = [omni.generate(t, params)[0] for t in texts[1:]]
    expected = torch.from_numpy(ref["preset"]["wav0"])
    torch.testing.assert_close(both[0].tensors["audio"], expected, atol=WAV_ATOL, rtol=0)
    for together, single in zip(both[1:], alone):
        assert together.tensors["audio"].shape == single.tensors["audio"].shape
        torch.testing.assert_close(together.tensors["audio"], single.tensors["audio"], atol=WAV_ATOL, rtol=0)


def test_audio_streams_in_chunks(ref: dict) -> None:
    """AsyncOmni: the audio arrives in several deltas, which concatenate to the reference's
    waveform (chunks of 3 frames first, then 4)."""
    mode, fields = CASES["design"]
    engine = AsyncOmni(str(ref["root"] / mode), device="cpu", backend="inproc",
                       connector="inproc", stage_overrides=["code2wav.generation.options.chunk_frames=4",
                                                            "code2wav.generation.options.first_chunk_frames=3"])

    async def run() -> list:
        return [o async for o in engine.generate(fields["text"], greedy(**voice("design")))]

    try:
        outs = asyncio.run(run())
    finally:
        engine.shutdown()
    deltas = [o.delta_tensors["audio"] for o in outs if "audio" in o.delta_tensors]
    assert len(deltas) >= 2         # several deltas (a step may carry several chunks)
    torch.testing.assert_close(torch.cat(deltas), torch.from_numpy(ref["design"]["wav0"]),
                               atol=WAV_ATOL, rtol=0)


def test_sampling_follows_the_seed(ref: dict) -> None:
    """Sampled talker and code predictor (the reference's temperature 0.9, top-k 50): a seed
    gives the same speech again, another seed other speech."""
    params = replace(greedy(**voice("preset")), temperature=0.9, top_k=50, seed=7)
    with engine(ref["root"], "custom_voice") as omni:
        first, again = (omni.generate("Hello world.", params)[0] for _ in range(2))
        other = omni.generate("Hello world.", replace(params, seed=8))[0]
    assert torch.equal(first.tensors["audio"], again.tensors["audio"])
    a, b = first.tensors["audio"], other.tensors["audio"]
    assert a.shape != b.shape or not torch.allclose(a, b)


def test_bad_voices_are_refused(ref: dict) -> None:
    with engine(ref["root"], "custom_voice") as omni:
        with pytest.raises(ValueError, match="speaker 'nobody'"):
            omni.generate("Hi.", greedy(voice="nobody"))
        (bad,) = omni.generate("Hi.", greedy(tone="sad"))     # refused by the talker stage
        assert "unknown keys ['tone']" in str(bad.error)
        (bad,) = omni.generate("Hi.", greedy(ref_audio=[0.0] * 2400))
        assert "ref_audio: a custom_voice model clones no voice" in str(bad.error)
        (after,) = omni.generate("Hi.", greedy(voice="vivian"))
    assert after.error is None and after.tensors["audio"].numel() > 0
    with engine(ref["root"], "base") as omni:
        (bad,) = omni.generate("Hi.", greedy(ref_audio=[0.1] * 10))
        assert "ref_audio: 10 samples" in str(bad.error)
        (bad,) = omni.generate("Hi.", greedy())
        assert "ref_audio: a Base model clones a voice" in str(bad.error)


def test_cli_generate_writes_the_audio_file(ref: dict, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    """`omnistage generate <tts folder> --prompt ... --voice ... --out a.wav` writes 24 kHz
    speech of whole frames; a second prompt with --out is refused before anything loads."""
    out = tmp_path / "a.wav"
    common = ["generate", str(ref["root"] / "custom_voice"), "--prompt", "Hello world.",
              "--device", "cpu", "--max-tokens", "8", "--stage-override", "backend=inproc",
              "--stage-override", "connector=inproc"]
    assert main(common + ["--voice", "vivian", "--instructions", "Whisper.", "--language",
                          "english", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    audio, rate = soundfile.read(out)
    assert rate == 24000 and audio.ndim == 1 and 0 < len(audio) <= 7 * 1920
    assert len(audio) % 1920 == 0
    assert main(common + ["--prompt", "Hi.", "--out", str(out)]) == 2
    assert "--out: one audio file for one prompt" in capsys.readouterr().err


def test_shipped_graph_with_stage_processes(ref: dict) -> None:
    """configs/qwen3_tts.yaml as is (each stage a process, shm between them): a voice clone's
    reference audio crosses to the talker, its frames and context marks to code2wav; the
    reference's waveform comes back."""
    with Omni(str(ref["root"] / "base"), device="cpu") as omni:
        (out,) = omni.generate(CASES["icl"][1]["text"], greedy(**voice("icl")))
    assert out.error is None, out.error
    expected = torch.from_numpy(ref["icl"]["wav0"])
    audio = out.tensors["audio"]
    assert 0 <= expected.shape[0] - audio.shape[0] <= 1
    torch.testing.assert_close(audio, expected[-audio.shape[0]:], atol=WAV_ATOL, rtol=0)
