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
