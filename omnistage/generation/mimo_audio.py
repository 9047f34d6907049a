"""MiMo-Audio's audio tokenizer decoder as a generation-stage model: the LLM stage's spoken
patches in (CodecFrames, (frames, channels) a chunk, as its feedback hook draws them), the
waveform out once the request's input closes: the whole utterance, decoded as upstream's
`MimoAudio.forward(..., return_audio=True)` decodes (frames with an empty channel 0 dropped,
segments of 1500 frames; models/mimo_audio/speech.py), so there is no seam to measure.

Not streamed yet: the decoder's transformer is causal with a left window, but its vocoder
attends a window both ways (and upstream streams by overlapping chunks, `streaming_decode`,
not ported), so a chunked decode would differ from the whole at each seam."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from omnistage.models.loader import resolve_model_path
from omnistage.models.mimo_audio.speech import codes_to_wave
from omnistage.models.mimo_audio.tokenizer_decoder import MiMoAudioTokenizerDecoder
from omnistage.payloads import SAMPLE_RATE, AudioChunk, CodecFrames

TOKENIZER_FOLDER = "audio_tokenizer"   # XiaomiMiMo/MiMo-Audio-Tokenizer inside the model folder


@dataclass(frozen=True, slots=True)
class MiMoAudioDecoderOptions:
    """The stage's `generation.options`: tokenizer, the audio tokenizer's folder (default:
    the model folder's audio_tokenizer/); empty_id, channel 0's empty id (a frame carrying it
    is silence upstream drops; default: the channel-0 codebook size)."""

    tokenizer: str | None = None
    empty_id: int | None = None


class MiMoAudioGenerator:
    Options = MiMoAudioDecoderOptions

    def __init__(self, model: MiMoAudioTokenizerDecoder,
                 options: MiMoAudioDecoderOptions = MiMoAudioDecoderOptions()) -> None:
        self.model = model
        self.options = options
        self.empty_id = (model.codebooks[0].shape[0] if options.empty_id is None
                         else options.empty_id)
        self.info = {SAMPLE_RATE: model.sample_rate}

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
        return False

    @torch.inference_mode()
    def generate(self, inputs: list[dict[str, Tensor]], states: list[dict],
                 is_last: list[bool]) -> list[dict[str, Tensor]]:
        out: list[dict[str, Tensor]] = []
        for x, state, last in zip(inputs, states, is_last):
            frames = CodecFrames.unpack(x)
            if frames is not None and frames.codes.numel():
                state.setdefault("spoken", []).append(frames.codes.to(torch.long).cpu())
            if not last:
                out.append({})
                continue
            codes = self.codes(state.pop("spoken", []))
            dev = self.model.codebooks[0].device
            out.append(AudioChunk(codes_to_wave(self.model, codes.to(dev)).float().cpu()).pack())
        return out

    def codes(self, chunks: list[Tensor]) -> Tensor:
        """(frames, channels) chunks -> (channels, frames), empty frames dropped."""
        if not chunks:
            return torch.zeros(len(self.model.codebooks), 0, dtype=torch.long)
        codes = torch.cat(chunks).T
        return codes[:, codes[0] != self.empty_id]
