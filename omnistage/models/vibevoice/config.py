"""VibeVoice's configuration, read from the checkpoint's config.json (and the noise schedule
from generation_config.json) in one place; model files read typed fields only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omnistage.models.config import ModelConfig
from omnistage.models.vibevoice.head import DiffusionHeadConfig
from omnistage.models.vibevoice.solver import NoiseSchedule
from omnistage.models.vibevoice.tokenizer import TokenizerConfig

ARCHITECTURE = "VibeVoiceForConditionalGeneration"
SAMPLE_RATE = 24000


@dataclass(frozen=True, slots=True)
class SpeechTokenIds:
    """The four ids the LM may emit (all others are masked): start / continue / end of a
    speech segment, and the end of the whole answer."""
    audio_bos: int
    audio_eos: int
    audio: int
    eos: int

    @property
    def allowed(self) -> tuple[int, ...]:
        return (self.audio_bos, self.audio_eos, self.audio, self.eos)


@dataclass(frozen=True, slots=True)
class VibeVoiceConfig:
    text: ModelConfig                   # the Qwen2 LM
    acoustic: TokenizerConfig           # audio_tower (encoder for voice clips, decoder)
    semantic: TokenizerConfig           # semantic_tokenizer_encoder (fed back each frame)
    head: DiffusionHeadConfig
    tokens: SpeechTokenIds
    pad_token_id: int
    schedule: NoiseSchedule
    num_diffusion_steps: int = 10       # the reference's default when generation_config names none
    guidance_scale: float = 1.0

    @classmethod
    def from_pretrained(cls, path: str | Path) -> VibeVoiceConfig:
        path = Path(path)
        doc = json.loads((path / "config.json").read_text())
        if doc.get("model_type") != "vibevoice":
            raise ValueError(f"{path}: model_type {doc.get('model_type')!r} is not 'vibevoice'")
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_json(doc, gen)

    @classmethod
    def from_json(cls, doc: dict[str, Any], gen: dict[str, Any]) -> VibeVoiceConfig:
        text = dict(doc["text_config"])
        if text.get("model_type", "qwen2") != "qwen2":
            raise NotImplementedError(f"text_config.model_type {text['model_type']!r}: only qwen2")
        if text.get("use_sliding_window"):
            raise NotImplementedError("text_config.use_sliding_window is not supported")
        text.setdefault("dtype", doc.get("dtype") or doc.get("torch_dtype") or "float32")
        text["torch_dtype"] = text.pop("dtype")
        text.setdefault("tie_word_embeddings", doc.get("tie_word_embeddings", False))
        eos = doc.get("eos_token_id", 151643)
        text["eos_token_id"] = eos
        lm = ModelConfig.from_hf(SimpleNamespace(**text), architecture=ARCHITECTURE)
        acoustic = TokenizerConfig.from_json(doc.get("audio_config") or {})
        semantic = TokenizerConfig.from_json({"hidden_size": 128,
                                              **(doc.get("semantic_model_config") or {})})
        if semantic.hop_length != acoustic.hop_length:
            raise ValueError(f"semantic hop {semantic.hop_length} != acoustic hop "
                             f"{acoustic.hop_length}: one semantic frame per latent frame")
        h = doc.get("diffusion_head_config") or {}
        if h.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"diffusion_head_config.hidden_act {h['hidden_act']!r}")
        head = DiffusionHeadConfig(
            hidden_size=lm.hidden_size, latent_size=acoustic.hidden_size,
            num_hidden_layers=h.get("num_hidden_layers", 4),
            intermediate_size=h.get("intermediate_size", 4608),
            rms_norm_eps=h.get("rms_norm_eps", 1e-5),
            frequency_embedding_size=h.get("frequency_embedding_size", 256),
            diffusion_max_period=h.get("diffusion_max_period", 10000))
        scheduler = gen.get("noise_scheduler_class", "DPMSolverMultistepScheduler")
        if scheduler != "DPMSolverMultistepScheduler":
            raise NotImplementedError(f"noise_scheduler_class {scheduler!r}: only "
                                      "DPMSolverMultistepScheduler")
        sched_doc = gen.get("noise_scheduler_config") or {
            "beta_schedule": "squaredcos_cap_v2", "prediction_type": "v_prediction"}
        return cls(
            text=lm, acoustic=acoustic, semantic=semantic, head=head,
            tokens=SpeechTokenIds(audio_bos=doc.get("audio_bos_token_id", 151652),
                                  audio_eos=doc.get("audio_eos_token_id", 151653),
                                  audio=doc.get("audio_token_id", 151654), eos=eos),
            pad_token_id=doc.get("pad_token_id", eos),
            schedule=NoiseSchedule.from_config(sched_doc),
            num_diffusion_steps=int(gen.get("num_diffusion_steps") or 10),
            guidance_scale=float(gen.get("guidance_scale") or 1.0))
