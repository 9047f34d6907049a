"""MiMo-Audio as stages of the runtime: the LLM with its patch decoder on the AR engine, the
audio tokenizer's decoder as a generation stage.

    llm (ar)          the processed prompt's ids (models/mimo_audio/prompt.py) + the answer's
                      start: <|sostm|> when the request goes on to the decoder (speech), else
                      upstream's text-dialogue start; prefilled as patch embeddings. Each step
                      the engine samples a text id; an <|empty|> id runs the patch decoder in
                      the model's feedback hook (4 frames x 8 channels of audio ids). Text ids
                      go out as text, speech patches as CodecFrames to the decoder stage.
                      Speech stops at <|eostm|> or <|im_end|> (upstream's MiMoStopper), text
                      at the tokenizer's EOS / <|im_end|>.
    decoder (gen)     the spoken frames -> 24 kHz audio, decoded in chunks while the LLM
                      still speaks (generation/mimo_audio.py)

The patch decoder draws with the request's temperature / top-k / top-p (upstream has its own
sampler settings for it). Speech in: a user turn's audio part, laid out by the front door
(models/mimo_audio/prompt.py), is encoded here by the audio tokenizer's encoder into its
speech patches. One voice, "default" (cloning from a prompt clip: not built).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from omnistage.configs.schema import StageConfig
from omnistage.errors import InputError
from omnistage.generation.mimo_audio import TOKENIZER_FOLDER
from omnistage.models.loader import resolve_model_path
from omnistage.models.mimo_audio.model import MiMoAudioForCausalLM
from omnistage.models.mimo_audio.prompt import (SPEECH_START, TEXT_START, SpecialIds,
                                                segment_ids, speech_patches, text_patches)
from omnistage.models.mimo_audio.tokenizer_encoder import MiMoAudioTokenizerEncoder
from omnistage.models.qwen3_omni.talker import FRAME_CODES
from omnistage.payloads import AUDIO_LENS, AUDIO_STARTS, AUDIO_WAVEFORMS, CodecFrames, Payload
from omnistage.registry import SpeechSpec
from omnistage.stages.ar import ARStage
from omnistage.stages.interface import StageInfo, StageRequest, StageResult
from omnistage.stages.voice import requested_voice

VOICE = "default"


def speech_spec(path: str | Path) -> SpeechSpec:
    """One preset voice, the model's own (cloning from a prompt clip: not built)."""
    return SpeechSpec(voices=(VOICE,))


def _load(path: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
    from transformers import AutoTokenizer

    special = SpecialIds.of(AutoTokenizer.from_pretrained(str(path)))
    model = MiMoAudioForCausalLM.from_pretrained(path, special.empty, device,
                                                 dtype or torch.float32)
    return model, model.model_config, None


class MiMoAudioStage(ARStage):
    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        super().__init__(stage, model, device, loader=_load)
        if self.engine.tokenizer is None:
            raise ValueError(f"{stage.model or model}: no text tokenizer (tokenizer.json)")
        self.special = SpecialIds.of(self.engine.tokenizer)
        self.starts = {speech: segment_ids(self.engine.tokenizer, list(segs))
                       for speech, segs in ((True, SPEECH_START), (False, TEXT_START))}
        self._encoder: MiMoAudioTokenizerEncoder | None = None      # speech in

    @property
    def model(self) -> MiMoAudioForCausalLM:
        return self.engine.model

    def decode_graph_variant(self) -> tuple[tuple[int, ...], bool]:
        """Every decode is fed embeddings (the feedback hook's patch)."""
        return self.stage.ar.output_hidden_layers, True

    def model_info(self) -> StageInfo:
        return StageInfo(speakers=(VOICE,))

    def add(self, request: StageRequest) -> None:
        params = request.params or self.defaults
        requested_voice(params.extra)
        if request.prompt_token_ids is None:
            raise InputError("prompt: MiMo-Audio takes messages or text (no embeddings)")
        speech = bool(request.downstream)
        ids = list(request.prompt_token_ids) + self.starts[speech]
        if speech:          # upstream's MiMoStopper: <|eostm|> ends the spoken reply
            stops = {*params.stop_token_ids, self.special.eostm, self.special.im_end}
            params = replace(params, stop_token_ids=tuple(sorted(stops)))
        dev = self.engine.device
        patches = text_patches(ids, self.model.cfg)
        if request.multimodal and AUDIO_WAVEFORMS in request.multimodal:
            patches = self._with_speech(patches, request.multimodal)
        with torch.no_grad():
            embeds = self.model.patch_embeds(patches.to(dev))
        self.engine.add_request(request.request_id, None, params, embeds.to(self.engine.dtype))

    def _with_speech(self, patches: torch.Tensor, mm: dict[str, torch.Tensor]) -> torch.Tensor:
        """The prompt's audio parts encoded (the audio tokenizer's encoder, loaded on first
        use) into the speech patches the front door laid out for them."""
        if self._encoder is None:
            self._encoder = MiMoAudioTokenizerEncoder.from_pretrained(
                resolve_model_path(self.engine.config.model) / TOKENIZER_FOLDER,
                self.engine.device)
        cfg = self.model.cfg
        waves = mm[AUDIO_WAVEFORMS].float().split(mm[AUDIO_LENS].tolist())
        for i, (wave, start) in enumerate(zip(waves, mm[AUDIO_STARTS].tolist())):
            ids = self._encoder.speech_ids(wave.to(self.engine.device), cfg.audio_channels,
                                           cfg.group_size)
            rows = speech_patches(ids.cpu(), cfg)
            laid = patches[start:start + rows.shape[0], 0, 0]
            if laid.shape[0] != rows.shape[0] or bool((laid != cfg.empty_idx).any()):
                raise InputError(f"audio part {i}: {rows.shape[0]} speech patches do not fit "
                                 "the prompt's layout", param="messages")
            patches[start:start + rows.shape[0]] = rows
        return patches

    def step(self) -> list[StageResult]:
        results = []
        for out in self.engine.step():
            codes = None if out.extra is None else out.extra[FRAME_CODES]
            payload = Payload(codec=None if codes is None else CodecFrames(codes.cpu()))
            results.append(StageResult(
                out.request_id, out.new_token_ids, out.text_delta, payload, out.finished,
                out.finish_reason.value if out.finish_reason else None, out.error,
                out.logprobs))
        return results


def build_stage(stage: StageConfig, model: str, device: str) -> ARStage:
    return MiMoAudioStage(stage, model, device)
