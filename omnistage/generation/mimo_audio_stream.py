"""MiMo-Audio's speech decoded while the LLM still speaks: chunks of code frames, each decoded
in a window of left and right context, as upstream's `MiMoAudioTokenizer.streaming_decode`.

Why not exact: the tokenizer decoder's transformer is causal and its vocoder sees a bounded
window, but both transposed convolutions end in GroupNorm(1), whose statistics span the whole
sequence decoded, so every frame's audio depends on every other frame. No carried state makes
a chunk equal to the whole decode; a window of context brings it close. The seam error, the
SNR of the streamed waveform against the whole one, is measured by
tests/golden/models/test_mimo_audio_stream.py on the tiny tokenizer (random weights, 120
random frames, RMS 0.16): 29-31 dB with the default options (chunks of 25 frames, the first
of 5, left 250, right the decoder's reach: 2 frames there), 25-27 dB with chunks of 8 and
left 25, 9-11 dB with no context at all; exact when the context covers the utterance.

    frames     |0 ........................ n|        (codes kept so far; n grows)
    window          |lo    |start    end|    hi|
                     left    emitted      right       audio of [start, end) goes out

A chunk [start, end) is ready once `right_frames` frames after it have arrived (or the input
is closed). Chunk boundaries are fixed (first_chunk_frames, then every chunk_frames), not set
by when frames arrive, so the audio of a request never depends on timing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from omnistage.models.mimo_audio.speech import codes_to_wave
from omnistage.models.mimo_audio.tokenizer_decoder import MiMoAudioTokenizerDecoder


@dataclass(frozen=True, slots=True)
class Chunking:
    """Sizes in code frames (25 a second in the released tokenizer)."""

    chunk_frames: int
    first_chunk_frames: int
    left_frames: int
    right_frames: int

    def __post_init__(self) -> None:
        if min(self.chunk_frames, self.first_chunk_frames) < 1:
            raise ValueError(f"MiMo-Audio decoder options {self}: chunk_frames and "
                             "first_chunk_frames must be >= 1 (0 chunk_frames: whole decodes)")
        if min(self.left_frames, self.right_frames) < 0:
            raise ValueError(f"MiMo-Audio decoder options {self}: left_frames and right_frames "
                             "must be >= 0")


@dataclass(frozen=True, slots=True)
class Window:
    lo: int         # first frame decoded
    start: int      # first frame whose audio goes out
    end: int        # past the last one
    hi: int         # past the last frame decoded


@dataclass(slots=True)
class MiMoAudioStream:
    """One request's frames and how far its audio has gone out. Changed only by replacing its
    fields (the generation engine's snapshots are shallow copies)."""

    chunking: Chunking
    codes: Tensor                   # (channels, n) spoken frames so far, long
    emitted: int = 0                # frames whose audio went out
    is_finished: bool = False       # the input is closed
    said_silence: bool = False      # an utterance without frames: its 1 s of silence went out

    @classmethod
    def empty(cls, chunking: Chunking, num_channels: int) -> MiMoAudioStream:
        return cls(chunking, torch.zeros(num_channels, 0, dtype=torch.long))

    def append(self, codes: Tensor) -> None:
        """codes (channels, k), k >= 0."""
        assert not self.is_finished, "frames after the input closed"
        self.codes = torch.cat([self.codes, codes.to(torch.long)], dim=1)

    def finish(self) -> None:
        self.is_finished = True

    def next_window(self) -> Window | None:
        n, c = self.codes.shape[1], self.chunking
        end = self.emitted + (c.first_chunk_frames if self.emitted == 0 else c.chunk_frames)
        if not self.is_finished and end + c.right_frames > n:
            return None
        end = min(end, n)
        if end <= self.emitted:
            return None
        return Window(max(0, self.emitted - c.left_frames), self.emitted, end,
                      min(n, end + c.right_frames))

    @property
    def has_ready_chunk(self) -> bool:
        return self.next_window() is not None or self._owes_silence

    @property
    def _owes_silence(self) -> bool:
        return self.is_finished and self.codes.shape[1] == 0 and not self.said_silence

    def decode_next(self, decoder: MiMoAudioTokenizerDecoder) -> Tensor | None:
        """The next ready chunk's audio (samples,), on the decoder's device; None: none ready."""
        device = decoder.codebooks[0].device
        if self._owes_silence:          # upstream's whole decode of no frames: 1 s of silence
            self.said_silence = True
            return codes_to_wave(decoder, self.codes.to(device))
        w = self.next_window()
        if w is None:
            return None
        wave = decoder(self.codes[:, w.lo:w.hi].to(device))
        self.emitted = w.end
        spf = decoder.frame_samples
        return wave[(w.start - w.lo) * spf:(w.end - w.lo) * spf]


def stream_decode(decoder: MiMoAudioTokenizerDecoder, codes: Tensor,
                  chunking: Chunking) -> list[Tensor]:
    """codes (channels, frames), all known -> the chunks of audio a stream sends for them."""
    stream = MiMoAudioStream.empty(chunking, codes.shape[0])
    stream.append(codes.cpu())
    stream.finish()
    chunks = []
    while (wave := stream.decode_next(decoder)) is not None:
        chunks.append(wave)
    return chunks
