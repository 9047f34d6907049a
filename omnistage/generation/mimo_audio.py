"""MiMo-Audio's audio tokenizer decoder as a generation-stage model: the LLM stage's spoken
patches in (CodecFrames, (frames, channels) a chunk, as its feedback hook draws them; frames
with an empty channel 0, silence upstream drops, dropped), audio out.

Streamed (the default): a chunk of frames is decoded as soon as its right context has
arrived, in a window of context (generation/mimo_audio_stream.py: why it cannot be exact, and
its measured seam error). Whole (`chunk_frames: 0`): the utterance decoded once the LLM is
done, as upstream's `MimoAudio.forward(..., return_audio=True)` does (segments of 1500
frames; models/mimo_audio/speech.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from omnistage.generation.mimo_audio_stream import Chunking, MiMoAudioStream
from omnistage.models.loader import resolve_model_path
from omnistage.models.mimo_audio.speech import codes_to_wave
from omnistage.models.mimo_audio.tokenizer_decoder import MiMoAudioTokenizerDecoder
from omnistage.payloads import SAMPLE_RATE, AudioChunk, CodecFrames

TOKENIZER_FOLDER = "audio_tokenizer"   # XiaomiMiMo/MiMo-Audio-Tokenizer inside the model folder


@dataclass(frozen=True, slots=True)
class MiMoAudioDecoderOptions:
    """The stage's `generation.options`: tokenizer, the audio tokenizer's folder (default:
    the model folder's audio_tokenizer/); empty_id, channel 0's empty id (a frame carrying it
    is silence upstream drops; default: the channel-0 codebook size). Streaming, in code
    frames (25 a second in the released tokenizer): chunk_frames (0: whole decodes),
    first_chunk_frames (a short first chunk, an early first audio), left_frames (upstream's
    StreamingConfig.left_overlap, 250), right_frames (default: the decoder's right reach,
    `right_reach_frames`, 41 in the released tokenizer; upstream's right_overlap is 40)."""

    tokenizer: str | None = None
    empty_id: int | None = None
    chunk_frames: int = 25
    first_chunk_frames: int = 5
    left_frames: int = 250
    right_frames: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_frames < 0:
            raise ValueError(f"chunk_frames={self.chunk_frames}: must be >= 0")
        if self.chunk_frames:           # checked now, not at the first request
            Chunking(self.chunk_frames, self.first_chunk_frames, self.left_frames,
                     self.right_frames or 0)


class MiMoAudioGenerator:
    Options = MiMoAudioDecoderOptions

    def __init__(self, model: MiMoAudioTokenizerDecoder,
                 options: MiMoAudioDecoderOptions = MiMoAudioDecoderOptions()) -> None:
        self.model = model
        self.options = options
        self.empty_id = (model.codebooks[0].shape[0] if options.empty_id is None
                         else options.empty_id)
        self.info = {SAMPLE_RATE: model.sample_rate}
        o = options
        self.chunking = None if o.chunk_frames == 0 else Chunking(
            o.chunk_frames, o.first_chunk_frames, o.left_frames,
            model.right_reach_frames if o.right_frames is None else o.right_frames)

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str, device: torch.device,
                        dtype: torch.dtype | None,
                        options: MiMoAudioDecoderOptions = MiMoAudioDecoderOptions()
                        ) -> MiMoAudioGenerator:
        """The decoder runs in float32 whatever the stage's dtype (upstream decodes so)."""
        folder = (Path(options.tokenizer) if options.tokenizer
                  else resolve_model_path(str(path)) / TOKENIZER_FOLDER)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder}: no MiMo-Audio tokenizer (config.json); set "
                                    "generation.options.tokenizer")
        return cls(MiMoAudioTokenizerDecoder.from_pretrained(folder, device), options)

    def has_backlog(self, state: dict) -> bool:
        stream = state.get("stream")
        return stream is not None and stream.has_ready_chunk

    @torch.inference_mode()
    def generate(self, inputs: list[dict[str, Tensor]], states: list[dict],
                 is_last: list[bool]) -> list[dict[str, Tensor]]:
        if self.chunking is not None:
            return [self._stream_step(x, state, last)
                    for x, state, last in zip(inputs, states, is_last)]
        out: list[dict[str, Tensor]] = []
        for x, state, last in zip(inputs, states, is_last):
            frames = CodecFrames.unpack(x)
            if frames is not None and frames.codes.numel():
                state["spoken"] = [*state.get("spoken", []), self.kept(frames.codes)]
            if not last:
                out.append({})
                continue
            spoken = state.pop("spoken", [])
            codes = (torch.cat(spoken, dim=1) if spoken else
                     torch.zeros(len(self.model.codebooks), 0, dtype=torch.long))
            dev = self.model.codebooks[0].device
            out.append(AudioChunk(codes_to_wave(self.model, codes.to(dev)).float().cpu()).pack())
        return out

    def _stream_step(self, x: dict[str, Tensor], state: dict, last: bool) -> dict[str, Tensor]:
        """The request's new frames into its stream; its next ready chunk's audio, if any
        (one a step: more ready ones are backlog)."""
        frames = CodecFrames.unpack(x)
        kept = self.kept(frames.codes) if frames is not None and frames.codes.numel() else None
        stream = state.get("stream")
        if stream is None:
            if kept is None and not last:
                return {}
            assert self.chunking is not None
            # the LLM's channels (8 in the release), not the tokenizer's quantizers (20)
            channels = len(self.model.codebooks) if kept is None else kept.shape[0]
            stream = state["stream"] = MiMoAudioStream.empty(self.chunking, channels)
        if kept is not None:
            stream.append(kept)
        if last and not stream.is_finished:
            stream.finish()
        wave = stream.decode_next(self.model)
        return {} if wave is None else AudioChunk(wave.float().cpu()).pack()

    def kept(self, frames: Tensor) -> Tensor:
        """(frames, channels) drawn -> (channels, kept frames), empty frames dropped."""
        codes = frames.to(torch.long).cpu().T
        return codes[:, codes[0] != self.empty_id]
