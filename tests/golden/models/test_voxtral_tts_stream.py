"""Voxtral-TTS's codec decoder streamed (generation/voxtral_tts.py, `chunk_frames`): chunks
decoded with a left context give the whole decode's samples (the decoder golden vs vLLM-Omni
in test_voxtral_tts.py); the seam error is measured against the waveform's size, and a left
context shorter than the decoder's receptive field fails."""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.generation.voxtral_tts import VoxtralDecoderOptions, VoxtralTTSGenerator
from omnistage.models.voxtral_tts.codec import VoxtralCodecDecoder
from omnistage.payloads import AudioChunk, CodecFrames

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "voxtral_tts" / "tiny"


def _frames(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.cat([torch.randint(2, 42, (n, 1), generator=g),
                      torch.randint(2, 23, (n, 6), generator=g)], 1)


def _stream(codec: VoxtralCodecDecoder, frames: torch.Tensor, per_step: int,
            **options: int) -> torch.Tensor:
    gen = VoxtralTTSGenerator(codec, VoxtralDecoderOptions(**options))
    state: dict = {}
    parts = []
    steps = list(frames.split(per_step))
    for i, f in enumerate(steps):
        out = gen.generate([CodecFrames(f).pack()], [state], [i == len(steps) - 1])[0]
        if out:
            parts.append(AudioChunk.unpack(out).samples)
    assert len(parts) > 2 or options.get("chunk_frames", 0) == 0
    return torch.cat(parts)


def test_streamed_chunks_equal_the_whole_decode() -> None:
    codec = VoxtralCodecDecoder.from_pretrained(TINY).float().eval()
    frames = _frames(37)
    whole = _stream(codec, frames, 4)                               # chunk_frames 0: at the end
    assert whole.numel() == 37 * codec.cfg.samples_per_frame and whole.std() > 0.1
    for per_step, chunk, first in [(1, 5, 2), (3, 4, None), (7, 6, 1)]:
        got = _stream(codec, frames, per_step, chunk_frames=chunk, first_chunk_frames=first)
        seam = (got - whole).abs().max() / whole.abs().max()
        assert got.shape == whole.shape and seam < 1e-5, (per_step, chunk, float(seam))
    short = _stream(codec, frames, 1, chunk_frames=5, first_chunk_frames=2, left_context=1)
    assert (short - whole).abs().max() / whole.abs().max() > 1e-3     # the context matters


def test_requests_in_one_call_equal_each_alone() -> None:
    """The stage hands the decoder every request of a step: chunks of one length decode in
    one batched forward (two requests that started together), others alone (a third, three
    steps behind); each request's audio equals its stream alone."""
    codec = VoxtralCodecDecoder.from_pretrained(TINY).float().eval()
    g = torch.Generator().manual_seed(5)
    frames = {r: torch.cat([torch.randint(2, 42, (n, 1), generator=g),
                            torch.randint(2, 23, (n, 6), generator=g)], 1)
              for r, n in (("a", 23), ("b", 23), ("c", 17))}
    start = {"a": 0, "b": 0, "c": 3}
    options = dict(chunk_frames=5, first_chunk_frames=2)
    gen = VoxtralTTSGenerator(codec, VoxtralDecoderOptions(**options))
    states: dict[str, dict] = {r: {} for r in frames}
    parts: dict[str, list] = {r: [] for r in frames}
    calls = []
    gen_decode = gen.decode_batch
    gen.decode_batch = lambda chunks: calls.append(len(chunks)) or gen_decode(chunks)
    for step in range(max(start[r] + len(f) for r, f in frames.items())):
        live = [r for r in frames if 0 <= step - start[r] < len(frames[r])]
        outs = gen.generate([CodecFrames(frames[r][step - start[r]:][:1]).pack() for r in live],
                            [states[r] for r in live],
                            [step - start[r] == len(frames[r]) - 1 for r in live])
        for r, out in zip(live, outs):
            if out:
                parts[r].append(AudioChunk.unpack(out).samples)
    assert max(calls) >= 2                                          # a and b decoded together
    for r, f in frames.items():
        alone = _stream(codec, f, 1, **options)
        got = torch.cat(parts[r])
        assert got.shape == alone.shape and alone.abs().max() > 0.1
        assert (got - alone).abs().max() <= 1e-5 * alone.abs().max(), r
