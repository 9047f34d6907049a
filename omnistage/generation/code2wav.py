"""Qwen3-Omni's code2wav and Qwen3-TTS's speech decoder as a generation-stage model: codec
frames in (any number per chunk), streamed audio out, exactly the whole decode
(`Code2WavStream`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from omnistage.models.loader import resolve_model_path
from omnistage.models.qwen3_omni.code2wav import Code2Wav
from omnistage.models.qwen3_omni.code2wav_stream import (Code2WavStream, VocoderGraphs,
                                                         VocoderShapes, decode_streams)
from omnistage.models.qwen3_tts.speech_decoder import Qwen3TTSSpeechDecoder
from omnistage.payloads import SAMPLE_RATE, AudioChunk, CodecFrames


@dataclass(frozen=True, slots=True)
class Code2WavOptions:
    """A code2wav stage's `generation.options` (see Code2WavGenerator)."""

    chunk_frames: int = 25
    left_context: int | None = None          # default: the vocoder's receptive field
    first_chunk_frames: int | None = None    # default: chunk_frames
    max_batch_frames: int = 400
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        for name in ("chunk_frames", "left_context", "first_chunk_frames", "max_batch_frames"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: must be >= 1")


class Code2WavGenerator:
    """The generation stage's model: codec frames in (any number per chunk), audio out as soon
    as a chunk of `chunk_frames` frames is complete (the first one: `first_chunk_frames`, for
    an early first audio), each vocoded with `left_context` frames before it (default: the
    vocoder's receptive field), exactly the whole decode (see `Code2WavStream`). Ready chunks
    of all requests share one forward of at most `max_batch_frames` frames, first chunks
    first; what does not fit waits for the next step (`has_backlog`), so that one large
    forward never holds a GPU shared with the talker for long.

    A chunk may carry `skip_frames` (a count per chunk): that many of its first frames are
    left context only, decoded but their audio dropped (a voice clone's reference frames)."""

    Options = Code2WavOptions

    def __init__(self, model: Code2Wav, options: Code2WavOptions = Code2WavOptions()) -> None:
        self.model = model
        self.options = options
        self.chunk_frames = options.chunk_frames
        self.first_chunk_frames = options.first_chunk_frames
        self.left_context = left_context = options.left_context
        self.max_batch_frames = options.max_batch_frames
        self.info = {SAMPLE_RATE: model.cfg.sample_rate}
        self.shapes: VocoderShapes | None = None
        self.graphs: VocoderGraphs | None = None
        if model.device.type == "cuda":   # a few padded shapes, each planned now, not mid-stream
            context = (model.cfg.receptive_field_frames if left_context is None
                       else left_context)
            self.shapes = VocoderShapes.for_stream(self.first_chunk_frames or self.chunk_frames,
                                                   self.chunk_frames, context,
                                                   self.max_batch_frames)
            self.plan_shapes()
            if options.cuda_graphs:     # the small batches replayed (launches: most of the time)
                self.graphs = VocoderGraphs(model, self.shapes)

    @torch.inference_mode()
    def plan_shapes(self) -> None:
        """Run the vocoder once at every padded shape (cuDNN plans its convolutions)."""
        if self.shapes is None:
            return
        model = self.model
        for num, frames in self.shapes.all():
            model.vocode(torch.zeros(num, frames, model.row_size, dtype=model.dtype,
                                     device=model.device))

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str, device: torch.device,
                        dtype: torch.dtype | None,
                        options: Code2WavOptions = Code2WavOptions()) -> Code2WavGenerator:
        """component: qwen3_omni_code2wav (the checkpoint's code2wav.*) or qwen3_tts_code2wav
        (its speech_tokenizer/ folder's decoder)."""
        folder = resolve_model_path(str(path))
        if component == "qwen3_tts_code2wav":
            model = Qwen3TTSSpeechDecoder.from_pretrained(folder / "speech_tokenizer", device,
                                                          dtype)
        else:
            model = Code2Wav.from_pretrained(folder, device, dtype)
        return cls(model.eval(), options)

    def has_backlog(self, state: dict) -> bool:
        stream = state.get("stream")
        return stream is not None and stream.has_ready_chunk

    def generate(self, inputs: list[dict[str, Tensor]], states: list[dict],
                 is_last: list[bool]) -> list[dict[str, Tensor]]:
        streams = []
        for x, state, last in zip(inputs, states, is_last):
            stream = state.get("stream")
            if stream is None:
                stream = state["stream"] = Code2WavStream(self.model, self.chunk_frames,
                                                          self.left_context,
                                                          self.first_chunk_frames)
            frames = CodecFrames.unpack(x)
            if frames is not None and frames.codes.numel():
                stream.append(frames.codes.T.to(torch.long))                # (Q, n)
            if frames is not None and frames.skip_frames is not None:
                state["skip"] = state.get("skip", 0) + frames.skip_frames * \
                    self.model.total_upsample
            if last and not stream.is_finished:
                stream.finish()
            streams.append(stream)
        audio = decode_streams(streams, self.max_batch_frames, self.shapes, self.graphs)
        for i, state in enumerate(states):       # context-only samples: dropped
            skip = min(state.get("skip", 0), audio[i].numel())
            if skip:
                audio[i], state["skip"] = audio[i][skip:], state["skip"] - skip
        sizes = [a.numel() for a in audio]
        if not any(sizes):    # frames buffered, no chunk complete: the device stays untouched
            return [{} for _ in audio]
        host = torch.cat(audio).float().cpu().split(sizes)     # one copy to the host
        return [AudioChunk(a).pack() if a.numel() else {} for a in host]
