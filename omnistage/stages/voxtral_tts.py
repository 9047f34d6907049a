"""Voxtral-TTS as stages of the runtime: the Mistral backbone with its flow-matching head on the
AR engine, the codec decoder as a generation stage (generation/voxtral_tts.py).

    speaker (ar)     the request's text and preset voice -> mistral-common's speech prompt
                     (models/voxtral_tts/tekken.py, from the folder's tekken.json):
                     [<s>] [BEGIN_AUDIO] [AUDIO] x n [NEXT_AUDIO_TEXT] text
                     [REPEAT_AUDIO_TEXT] [BEGIN_AUDIO]; the [AUDIO] run takes the voice's
                     ready embeddings (voice_embedding/<name>.pt, as vLLM-Omni places them).
                     Each step the head draws one frame (37 codes) in the feedback hook; the
                     frames go out as CodecFrames; the semantic [END_AUDIO] ends the request.
    decoder (gen)    the frames -> 24 kHz audio (the codec decoder)

Options: `ar.options.cfg_alpha` (the head's guidance, vLLM-Omni's 1.2), per request
`SamplingParams.extra["cfg_alpha"]`; the request's `seed` seeds the head's noise. Voices: the
presets of tekken.json's `audio.voice_num_audio_tokens` that have a `voice_embedding/<name>.pt`
(vLLM-Omni's default, cheerful_female, first where it exists). No cloning: the released codec
has no encoder weights.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from omnistage.configs.schema import StageConfig
from omnistage.errors import InputError
from omnistage.layers.graph_capture import RowGraphs, checked
from omnistage.models.loader import resolve_model_path
from omnistage.models.qwen3_omni.talker import FRAME_CODES
from omnistage.models.voxtral_tts.head import VoxtralFlowHead
from omnistage.models.voxtral_tts.model import CFG_ALPHA, DEFAULT_CFG_ALPHA, \
    VoxtralTTSForCausalLM
from omnistage.models.voxtral_tts.tekken import Tekken
from omnistage.payloads import CodecFrames, Payload
from omnistage.registry import SpeechSpec
from omnistage.stages.ar import ARStage
from omnistage.stages.interface import StageInfo, StageRequest, StageResult
from omnistage.stages.voice import requested_voice

TOKENIZER = "tekken.json"
VOICES = "voice_embedding"
DEFAULT_VOICE = "cheerful_female"       # vLLM-Omni's when none is named
SAMPLE_RATE = 24000


def preset_voices(path: str | Path) -> tuple[str, ...]:
    """tekken.json's voices that have their embeddings in voice_embedding/, the default first."""
    folder = Path(path)
    names = [v for v in Tekken.from_file(folder / TOKENIZER).voice_frames
             if (folder / VOICES / f"{v}.pt").is_file()]
    return tuple(sorted(names, key=lambda v: v != DEFAULT_VOICE))


def speech_spec(path: str | Path) -> SpeechSpec:
    return SpeechSpec(voices=preset_voices(path))


@dataclass(frozen=True, slots=True)
class VoxtralTTSOptions:
    """The stage's `ar.options`: cfg_alpha, the head's classifier-free guidance;
    head_cuda_graphs: on CUDA, replay the head's frame (7 guided Euler steps through its
    transformer) as one CUDA graph per batch-size bucket (checked against eager at start-up)."""
    cfg_alpha: float = 1.2
    head_cuda_graphs: bool = True


def _load(path: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
    eos = Tekken.from_file(path / TOKENIZER).special.get("</s>", 2)
    model = VoxtralTTSForCausalLM.from_pretrained(path, device, dtype or torch.float32, eos)
    return model, model.model_config, None


class VoxtralTTSStage(ARStage):
    """An entry stage: text and a preset voice in, the frames out as the head draws them."""

    Options = VoxtralTTSOptions

    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        super().__init__(stage, model, device, loader=_load)
        self.folder = resolve_model_path(self.engine.config.model)
        self.tekken = Tekken.from_file(self.folder / TOKENIZER)
        self.voices = {v: None for v in preset_voices(self.folder)}

    @property
    def model(self) -> VoxtralTTSForCausalLM:
        return self.engine.model

    def prepare(self) -> None:
        if (self.engine.device.type == "cuda" and not self.stage.ar.enforce_eager
                and self.options.head_cuda_graphs):
            self.model.head_graphs = head_graphs(self.model.head, self.stage.ar.max_num_seqs,
                                                 self.engine.device, self.engine.dtype)

    def decode_graph_variant(self) -> tuple[tuple[int, ...], bool]:
        """Every decode is fed embeddings (the frame's packed embedding)."""
        return self.stage.ar.output_hidden_layers, True

    def model_info(self) -> StageInfo:
        return StageInfo(sample_rate=SAMPLE_RATE, speakers=tuple(self.voices))

    def voice_rows(self, name: str) -> torch.Tensor:
        if self.voices[name] is None:
            self.voices[name] = torch.load(self.folder / VOICES / f"{name}.pt",
                                           map_location="cpu", weights_only=True)
        return self.voices[name]

    def add(self, request: StageRequest) -> None:
        if request.streamed:
            raise ValueError("the Voxtral-TTS stage is an entry stage")
        params = request.params or self.defaults
        asked = requested_voice(params.extra, takes=(CFG_ALPHA,))
        names = {v.lower(): v for v in self.voices}
        voice = names.get((asked or next(iter(self.voices), "")).lower())
        if voice is None:
            raise InputError(f"voice: {asked!r} is not a preset voice of this model "
                             f"({', '.join(self.voices)})", param="voice")
        if not request.prompt:
            raise InputError("input: empty text", param="input")
        if CFG_ALPHA not in params.extra:
            params = replace(params, extra={**params.extra, CFG_ALPHA: self.options.cfg_alpha})
        ids = torch.tensor(self.tekken.speech_prompt(request.prompt, voice),
                           device=self.engine.device)
        with torch.no_grad():
            embeds = self.model.prompt_embeds(ids, self.voice_rows(voice))
        self.engine.add_request(request.request_id, None, params, embeds.to(self.engine.dtype))

    def step(self) -> list[StageResult]:
        results = []
        for out in self.engine.step():
            result = self.result(out)
            codes = None if out.extra is None else out.extra.get(FRAME_CODES)
            result.payload = Payload(codec=None if codes is None
                                     else CodecFrames(codes.reshape(1, -1).cpu()))
            results.append(result)
        return results


@torch.inference_mode()
def head_graphs(head: VoxtralFlowHead, max_batch: int, device: torch.device,
                dtype: torch.dtype) -> RowGraphs | None:
    """The head's CUDA graphs, if a frame of 2 rows replayed through them equals the eager
    run, every bucket then captured; otherwise None, and the head runs eagerly."""
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(2, head.cfg.input_dim, device=device, generator=gen).to(dtype)
    alpha = torch.full((2,), DEFAULT_CFG_ALPHA, device=device, dtype=dtype)
    noise = torch.randn(2, head.cfg.n_acoustic_codebook, device=device, generator=gen).to(dtype)
    graphs = RowGraphs(head, (h, alpha, noise), max_batch)
    return checked(graphs, graphs.capture_all,
                   [(lambda: head(h, alpha, noise), lambda: graphs(h, alpha, noise))],
                   "the Voxtral-TTS head")


def build_stage(stage: StageConfig, model: str, device: str) -> ARStage:
    return VoxtralTTSStage(stage, model, device)
