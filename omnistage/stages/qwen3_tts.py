"""Qwen3-TTS as two stages of the runtime: what `qwen_tts`'s `generate_*` does in one call,
split so that audio streams while the talker speaks.

    talker (ar)     the request's text and voice -> the mode's prompt (models/qwen3_tts/
                    prompt.py), prefilled as embeddings; the text rows after the first go in
                    as the engine's stream (one added to each decode, then tts_pad for ever);
                    each sampled code 0 runs the code predictor (the model's feedback hook)
    code2wav (gen)  codec frames -> 24 kHz audio, chunk by chunk, exactly the whole decode,
                    chunks of different requests in one forward (generation/code2wav.py)

The voice rides in `SamplingParams.extra` of the talker: "voice" (a preset speaker, for
CustomVoice), "instructions" (CustomVoice's style, VoiceDesign's described voice), "language"
(default "auto"), and for Base models "ref_audio" (24 kHz samples, a list of floats; or, as
the speech API sends it, {"samples": float32 little-endian mono bytes, "sample_rate": int},
resampled to 24 kHz) with an optional "ref_text" (its transcript: in-context cloning; without it the speaker embedding
alone). An in-context clone's reference frames go first to code2wav, which decodes them as
left context and drops their audio (`skip_frames`), as the reference decodes and cuts.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from omnistage.ar.inputs import StreamInput
from omnistage.configs.schema import StageConfig
from omnistage.errors import InputError
from omnistage.models.loader import resolve_model_path
from omnistage.models.qwen3_tts.config import Qwen3TTSConfig
from omnistage.models.qwen3_tts.prompt import PromptBuilder, SpeechRequest
from omnistage.models.qwen3_tts.speaker_encoder import Qwen3TTSSpeakerEncoder
from omnistage.models.qwen3_tts.speech_encoder import Qwen3TTSSpeechEncoder
from omnistage.models.qwen3_omni.talker import FRAME_CODES
from omnistage.models.qwen3_tts.talker import Qwen3TTSTalkerForCausalLM
from omnistage.payloads import CodecFrames, Payload
from omnistage.registry import SpeechSpec
from omnistage.stages.adapters import StageFeed
from omnistage.stages.ar import ARStage
from omnistage.stages.qwen3_tts_text import WrittenText
from omnistage.stages.interface import StageInfo, StageRequest, StageResult
from omnistage.stages.qwen3_omni import CodePredictorOptions, code_predictor_graphs
from omnistage.stages.voice import reference_waveform, requested_voice

# what the talker reads from `extra` besides the voice (stages/voice.py)
VOICE_OPTIONS = ("instructions", "language", "ref_audio", "ref_text", "non_streaming_mode")
MIN_REF_SAMPLES = 2400     # 0.1 s: the speaker encoder's mel frames need a few STFT windows
REF_RATE = 24000           # what the speaker and speech encoders take


def speech_spec(path: str | Path) -> SpeechSpec:
    """What /v1/audio/speech may ask of this checkpoint (its config.json's tts_model_type):
    CustomVoice its preset speakers (the first the default) with a style instruction,
    VoiceDesign a voice described in `instructions`, Base a voice cloned from reference audio;
    the languages its codec knows."""
    cfg = Qwen3TTSConfig.from_pretrained(resolve_model_path(str(path)))
    kind = cfg.model_type
    return SpeechSpec(voices=tuple(cfg.speakers) if kind == "custom_voice" else (),
                      cloning=kind == "base", voice_design=kind == "voice_design",
                      instructions=kind != "base",
                      languages=tuple(cfg.supported_languages))


def _load(path: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
    model = Qwen3TTSTalkerForCausalLM.from_pretrained(path, device, dtype)
    return model, model.model_config, model.config


class TalkerStage(ARStage):
    """The talker's AR engine, an entry stage: builds each request's prompt from its text and
    voice. Emits every step's frame but the last (whose code 0 is EOS, or which the length
    limit cut before the code predictor ran), as the reference; an in-context clone's first
    output also carries its reference frames, marked `skip_frames`."""

    Options = CodePredictorOptions

    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        super().__init__(stage, model, device, loader=_load)
        self.path = resolve_model_path(stage.model or model)
        self.config: Qwen3TTSConfig = self.engine.hf_config
        if self.engine.tokenizer is None:
            raise ValueError(f"{self.path}: no text tokenizer (tokenizer.json)")
        self.builder = PromptBuilder(self.config, self.model, self.engine.tokenizer)
        self._clone: tuple[Qwen3TTSSpeakerEncoder, Qwen3TTSSpeechEncoder] | None = None
        self._prefix: dict[str, Tensor] = {}    # request -> reference frames not yet emitted
        # requests whose text an upstream LLM writes (a voice agent)
        self.written = WrittenText(self.engine, self.builder, self.speech_request)

    @property
    def model(self) -> Qwen3TTSTalkerForCausalLM:
        return self.engine.model

    def prepare(self) -> None:
        stage = self.stage
        if not self.engine.ranks.is_leader:   # the code predictor runs on rank 0 alone
            return
        if (self.engine.device.type == "cuda" and not stage.ar.enforce_eager
                and self.options.code_predictor_cuda_graphs):
            self.model.code_predictor.graphs = code_predictor_graphs(
                self.model, stage.ar.max_num_seqs, self.engine.device, self.engine.dtype)

    def decode_graph_variant(self) -> tuple[tuple[int, ...], bool]:
        """Every decode is fed embeddings (the frame's codes and the text row)."""
        return self.stage.ar.output_hidden_layers, True

    def model_info(self) -> StageInfo:
        """Reported at the handshake: the preset voices and languages a request may name."""
        return StageInfo(speakers=tuple(sorted(self.config.speakers)),
                         languages=tuple(self.config.supported_languages),
                         tts_model_type=self.config.model_type)

    def add(self, request: StageRequest) -> None:
        params = request.params or self.defaults
        if request.streamed:      # a voice agent: the text comes from an LLM stage
            self.written.add(request.request_id, params)
            return
        speech = self.speech_request(request.prompt or "", params.extra)
        try:
            prompt = self.builder.build(speech)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        rid = request.request_id
        self.engine.add_request(rid, None, params, prompt.embeds, stream=StreamInput())
        self.engine.extend_request(rid, stream_embeds=prompt.trailing, close_stream=True,
                                   stream_pad=prompt.pad)
        if speech.ref_code is not None:
            self._prefix[rid] = speech.ref_code.cpu()

    def speech_request(self, text: str, extra: dict) -> SpeechRequest:
        """The request's text and the voice in its params' `extra`."""
        voice = requested_voice(extra, takes=VOICE_OPTIONS)   # `speaker` is `voice` too
        fields = dict(text=text, language=str(extra.get("language") or "auto"),
                      instruct=extra.get("instructions") or None,
                      non_streaming_mode=_optional_bool(extra, "non_streaming_mode"))
        if self.config.model_type == "custom_voice":
            fields["speaker"] = voice or None
        if self.config.model_type != "base":
            for key in ("ref_audio", "ref_text"):
                if extra.get(key) is not None:
                    raise InputError(f"{key}: a {self.config.model_type} model clones no "
                                     "voice (a Base model does)", param=key)
            return SpeechRequest(**fields)
        if extra.get("ref_audio") is None:
            raise InputError("ref_audio: a Base model clones a voice from 24 kHz reference "
                             "audio", param="ref_audio")
        speaker_encoder, speech_encoder = self.clone_encoders()
        wav = reference_waveform(extra["ref_audio"])
        if wav.numel() < MIN_REF_SAMPLES or not bool(torch.isfinite(wav).all()):
            raise InputError(f"ref_audio: {wav.numel()} samples; a clone needs at least "
                             f"{MIN_REF_SAMPLES} finite samples at 24 kHz", param="ref_audio")
        fields["speaker_embedding"] = speaker_encoder.embed_speaker(wav)
        if extra.get("ref_text"):
            fields.update(ref_code=speech_encoder.encode(wav), ref_text=str(extra["ref_text"]))
        return SpeechRequest(**fields)

    def clone_encoders(self) -> tuple[Qwen3TTSSpeakerEncoder, Qwen3TTSSpeechEncoder]:
        """The speaker encoder and the speech tokenizer's encoder, loaded when first needed."""
        if self._clone is None:
            dev, dtype = self.engine.device, self.engine.dtype
            self._clone = (Qwen3TTSSpeakerEncoder.from_pretrained(self.path, dev, dtype),
                           Qwen3TTSSpeechEncoder.from_pretrained(self.path / "speech_tokenizer",
                                                                 dev, torch.float32))
        return self._clone

    @property
    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests or self.written.has_done

    def feed(self, request_id: str, feed: StageFeed) -> None:
        if feed.text:
            self.written.feed(request_id, feed.text)

    def close_input(self, request_id: str) -> None:
        self.written.close(request_id)

    def abort(self, request_id: str) -> None:
        self._prefix.pop(request_id, None)
        if self.written.abort(request_id):
            super().abort(request_id)

    def step(self) -> list[StageResult]:
        results = self.written.unspoken()
        for out in self.engine.step():
            codes = None if out.extra is None else out.extra[FRAME_CODES]
            frames = torch.empty(0, self.config.num_code_groups, dtype=torch.long)
            if codes is not None and int(codes[0]) not in self.engine.eos_token_ids:
                frames = codes.reshape(1, -1).cpu()
            prefix = self._prefix.pop(out.request_id, None)
            skip = 0 if prefix is None else prefix.shape[0]
            if prefix is not None:
                frames = torch.cat([prefix, frames])
            payload = Payload(codec=CodecFrames(frames, skip_frames=skip)
                              if frames.numel() else None)
            results.append(StageResult(
                out.request_id, out.new_token_ids, "", payload, out.finished,
                out.finish_reason.value if out.finish_reason else None, out.error))
            if out.finished:
                self._prefix.pop(out.request_id, None)
        return results


def _optional_bool(extra: dict, key: str) -> bool | None:
    value = extra.get(key)
    if value is not None and not isinstance(value, bool):
        raise InputError(f"{key}: a boolean, got {value!r}", param=key)
    return value


def build_stage(stage: StageConfig, model: str, device: str) -> ARStage:
    return TalkerStage(stage, model, device)
