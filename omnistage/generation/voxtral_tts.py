"""Voxtral-TTS's codec decoder as a generation-stage model: the AR stage's frames in
(CodecFrames, (1, 37) a step, in the LLM's code space: the codec's codes + 2), the 24 kHz
waveform out once the request's input closes: the whole utterance, as vLLM-Omni decodes it
(the frames up to the first [END_AUDIO], which the AR stage never sends), so no seam.

Not streamed yet: the decoder is causal with bounded windows (2, 4, 8, 16 frames after the
upsampling stages), so chunks decoded with a left context would equal the whole decode; not
written here (docs/models/voxtral-tts.md, "What is left")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from omnistage.models.loader import resolve_model_path
from omnistage.models.voxtral_tts.codec import VoxtralCodecDecoder
from omnistage.models.voxtral_tts.config import N_SPECIALS
from omnistage.payloads import SAMPLE_RATE, AudioChunk, CodecFrames

_FRAMES, _DONE = "voxtral.frames", "voxtral.done"    # per-request state, not payloads


@dataclass(frozen=True, slots=True)
class VoxtralDecoderOptions:
    """The stage's `generation.options`: chunk_frames (0: the whole utterance at the end),
    first_chunk_frames (default chunk_frames), left_context (frames decoded before a chunk)."""

    chunk_frames: int = 0
    first_chunk_frames: int | None = None
    left_context: int = 32

    def __post_init__(self) -> None:
        for name in ("chunk_frames", "left_context"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.first_chunk_frames is not None and self.first_chunk_frames < 1:
            raise ValueError(f"first_chunk_frames={self.first_chunk_frames}: must be >= 1")


class VoxtralTTSGenerator:
    Options = VoxtralDecoderOptions

    def __init__(self, model: VoxtralCodecDecoder,
                 options: VoxtralDecoderOptions = VoxtralDecoderOptions()) -> None:
        self.model, self.options = model, options
        self.info = {SAMPLE_RATE: model.cfg.sampling_rate}

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str, device: torch.device,
                        dtype: torch.dtype | None,
                        options: VoxtralDecoderOptions = VoxtralDecoderOptions()
                        ) -> VoxtralTTSGenerator:
        """The decoder runs in float32 whatever the stage's dtype."""
        if path is None:
            raise ValueError("the Voxtral-TTS decoder stage needs the checkpoint folder")
        folder = resolve_model_path(str(path))
        return cls(VoxtralCodecDecoder.from_pretrained(folder, str(device)).float().eval(),
                   options)

    def has_backlog(self, state: dict) -> bool:
        return False

    @torch.inference_mode()
    def generate(self, inputs: list[dict[str, Tensor]], states: list[dict],
                 is_last: list[bool]) -> list[dict[str, Tensor]]:
        """Each request's ready chunk; the chunks of one length (the first chunks of requests
        that started together, most of all) decoded in one batched call."""
        jobs: list[tuple[Tensor, int] | dict[str, Tensor]] = []
        for x, state, last in zip(inputs, states, is_last):
            frames = CodecFrames.unpack(x)
            if frames is not None and frames.codes.numel():
                state.setdefault(_FRAMES, []).append(frames.codes.to(torch.long).cpu())
            jobs.append(self.ready(state, last))
        by_length: dict[int, list[int]] = {}
        for i, job in enumerate(jobs):
            if isinstance(job, tuple):
                by_length.setdefault(job[0].shape[0], []).append(i)
        waves: dict[int, Tensor] = {}
        for rows in by_length.values():
            batch = self.decode_batch([jobs[i][0] for i in rows])         # type: ignore[index]
            waves.update(zip(rows, batch))
        return [AudioChunk(waves[i][job[1]:]).pack() if isinstance(job, tuple) else job
                for i, job in enumerate(jobs)]

    def ready(self, state: dict, last: bool) -> tuple[Tensor, int] | dict[str, Tensor]:
        """The frames ready to decode (all at the end) as (frames (T, 37), samples of left
        context to drop), or a packed answer without decoding ({}: none; an empty chunk at an
        end with nothing left)."""
        frames = state.get(_FRAMES, [])
        total, done = sum(len(f) for f in frames), state.get(_DONE, 0)
        o = self.options
        if last:
            end = total
        elif o.chunk_frames == 0:
            return {}
        else:
            first = o.first_chunk_frames or o.chunk_frames
            end = first if done == 0 else done + o.chunk_frames
            if total < end:
                return {}
            if done > 0:
                end = done + (total - done) // o.chunk_frames * o.chunk_frames
        if end <= done or not frames:
            return AudioChunk(torch.zeros(0)).pack() if last else {}
        start = max(0, done - o.left_context)
        state[_DONE] = end
        return torch.cat(frames)[start:end], (done - start) * self.model.cfg.samples_per_frame

    def decode_batch(self, chunks: list[Tensor]) -> list[Tensor]:
        """Chunks of one length (T, 37) in the LLM's code space -> each (T * samples,)
        float32 on the CPU, in one forward (the decoder is per row: a row equals its
        decode alone) and one copy."""
        codes = (torch.stack(chunks) - N_SPECIALS).clamp(min=0).transpose(1, 2)   # (B, 37, T)
        dev = self.model.semantic_table.device
        return list(self.model(codes.to(dev)).float().cpu())
