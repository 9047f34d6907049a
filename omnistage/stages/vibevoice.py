"""VibeVoice as one stage of the runtime: the LM on the AR engine, its diffusion head, acoustic
decoder and semantic encoder in the engine's hooks (generation/vibevoice.py, VibeVoiceSpeaker),
so the stage writes the 24 kHz audio itself, frame by frame (3200 samples, 0.133 s, each).

    request text     a script, "Speaker 1: ..." lines (models/vibevoice/script.py); plain text
                     is one speaker's line
    voice            `SamplingParams.extra["ref_audio"]`: a clip (24 kHz samples, a list of
                     floats; or, as the speech API sends it, {"samples": float32 little-endian
                     mono bytes, "sample_rate": int}, resampled to 24 kHz), the voice of every
                     speaker of the script; or "voices": one such clip per speaker, in the
                     order the speakers first speak (the count must match: InputError naming
                     `voices`); "ref_text" (a transcript) is accepted and not read
    options          `ar.options`: guidance_scale, num_diffusion_steps (None: the checkpoint's
                     generation_config.json); the request's `seed` seeds its noise as
                     transformers' generate after `torch.manual_seed(seed)`
    out              each step's new frames as an AudioChunk; the LM is greedy over its four
                     speech ids, `max_tokens` bounds its steps

The clip is read as the reference reads it with `sample=False` (the encoder's mean latents).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from omnistage.configs.schema import StageConfig
from omnistage.errors import InputError
from omnistage.generation.vibevoice import VibeVoiceSpeaker
from omnistage.models.vibevoice.config import SAMPLE_RATE
from omnistage.models.vibevoice.model import VibeVoiceForConditionalGeneration
from omnistage.models.vibevoice.prompt import num_clip_frames, prompt_embeds
from omnistage.models.vibevoice.script import parse_script, script_ids
from omnistage.payloads import AudioChunk
from omnistage.registry import SpeechSpec
from omnistage.stages.ar import ARStage
from omnistage.stages.interface import StageInfo, StageRequest, StageResult
from omnistage.stages.voice import reference_waveform, requested_voice

VOICE_OPTIONS = ("ref_audio", "ref_text", "voices")
MAX_SPEAKERS = 4            # Microsoft's: a script of up to four speakers


@dataclass(frozen=True, slots=True)
class VibeVoiceOptions:
    """The stage's `ar.options`."""
    guidance_scale: float | None = None     # CFG of the head (and of the token choice if != 1)
    num_diffusion_steps: int | None = None  # DPM-Solver++ steps per frame


def speech_spec(path: str | Path) -> SpeechSpec:
    """No preset voices: each request brings its voice (a clip or an uploaded voice), one for
    every speaker or one per speaker (`voices`)."""
    return SpeechSpec(voices=(), cloning=True, speakers=MAX_SPEAKERS)


def clip_waveform(value: object, param: str = "ref_audio") -> Tensor:
    """A request's clip -> float32 (n,) at 24 kHz (InputError naming `param`); read as
    Qwen3-TTS reads its reference clip (stages/voice.py)."""
    try:
        wave = reference_waveform(value, SAMPLE_RATE, param)
    except InputError:
        raise
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InputError(f"{param}: not audio samples ({exc})", param=param) from None
    if wave.numel() == 0 or not bool(torch.isfinite(wave).all()):
        raise InputError(f"{param}: {wave.numel()} samples; a voice clip needs finite "
                         "samples", param=param)
    return wave


def speaker_clips(extra: dict, num_speakers: int) -> list[Tensor]:
    """Each speaker's clip: `voices` one per speaker, or `ref_audio` for all; [] for none."""
    voices = extra.get("voices")
    if voices is None:
        if extra.get("ref_audio") is None:
            return []
        return [clip_waveform(extra["ref_audio"])] * num_speakers
    if extra.get("ref_audio") is not None:
        raise InputError("voices: give voices (one per speaker) or ref_audio, not both",
                         param="voices")
    if not isinstance(voices, (list, tuple)) or len(voices) != num_speakers:
        n = len(voices) if isinstance(voices, (list, tuple)) else "not a list of"
        raise InputError(f"voices: {n} voices for a script of {num_speakers} speaker(s): give "
                         "one per speaker, in the order they first speak", param="voices")
    return [clip_waveform(v, f"voices[{i}]") for i, v in enumerate(voices)]


def _load(path: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
    model = VibeVoiceForConditionalGeneration.from_pretrained(path, device, dtype)
    return model, model.model_config, None


class VibeVoiceStage(ARStage):
    """An entry stage: a script and a voice in, audio out as the LM speaks."""

    Options = VibeVoiceOptions

    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        super().__init__(stage, model, device, loader=_load)
        if self.engine.tokenizer is None:
            raise ValueError(f"{stage.model or model}: no text tokenizer (tokenizer.json)")
        cfg = self.model.config
        self.guidance_scale = self.options.guidance_scale or cfg.guidance_scale
        self.num_diffusion_steps = self.options.num_diffusion_steps or cfg.num_diffusion_steps
        if self.num_diffusion_steps < 1:
            raise ValueError(f"stage {stage.name!r}: ar.options.num_diffusion_steps="
                             f"{self.num_diffusion_steps}: must be >= 1")

    @property
    def model(self) -> VibeVoiceForConditionalGeneration:
        return self.engine.model

    def prepare(self) -> None:
        self.speaker = VibeVoiceSpeaker(self.engine)

    def decode_graph_variant(self) -> tuple[tuple[int, ...], bool]:
        """Every decode is fed embeddings (a frame's, or the chosen id's)."""
        return self.stage.ar.output_hidden_layers, True

    def model_info(self) -> StageInfo:
        return StageInfo(sample_rate=SAMPLE_RATE)

    def add(self, request: StageRequest) -> None:
        if request.streamed:
            raise ValueError("the VibeVoice stage is an entry stage")
        params = request.params or self.defaults
        requested_voice(params.extra, takes=VOICE_OPTIONS)
        try:
            script = parse_script(request.prompt or "")
        except ValueError as exc:
            raise InputError(f"input: {exc}", param="input") from None
        clips = speaker_clips(params.extra, script.num_speakers)
        frames = [num_clip_frames(self.model, c.numel()) for c in clips] if clips else None
        tokenizer = self.engine.tokenizer
        ids = script_ids(lambda s: tokenizer.encode(s, add_special_tokens=False),
                         self.model.config.tokens, script, frames)
        device = self.engine.device
        embeds = prompt_embeds(self.model, torch.tensor(ids, device=device),
                               [c.to(device) for c in clips])
        generator = torch.Generator()
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        self.speaker.add(request.request_id, embeds, ids[-1], params.max_tokens, generator,
                         self.guidance_scale, self.num_diffusion_steps)

    def abort(self, request_id: str) -> None:
        self.speaker.drop(request_id)
        super().abort(request_id)

    def step(self) -> list[StageResult]:
        results = []
        for out in self.engine.step():
            result = self.result(out)
            state = self.speaker.states.get(out.request_id)
            if state is not None and len(state.audio) > state.num_taken:
                samples = torch.cat(state.audio[state.num_taken:]).float().cpu()
                state.num_taken = len(state.audio)
                result.payload.audio = AudioChunk(samples, SAMPLE_RATE)
            if out.finished:
                self.speaker.drop(out.request_id)
            results.append(result)
        return results


def build_stage(stage: StageConfig, model: str, device: str) -> ARStage:
    return VibeVoiceStage(stage, model, device)
