"""Qwen3-TTS's configuration, read from the checkpoint's config.json in one place.

transformers does not know the `qwen3_tts` model type (the `qwen-tts` package registers it), so
the JSON is read directly into our frozen dataclasses; model files read typed fields only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from omnistage.models.config import ModelConfig

MODEL_TYPES = ("custom_voice", "voice_design", "base")
ModelType = Literal["custom_voice", "voice_design", "base"]


@dataclass(frozen=True, slots=True)
class CodecIds:
    """The talker's control codes (its vocabulary above the codebook)."""
    pad: int
    bos: int
    eos: int
    think: int
    nothink: int
    think_bos: int
    think_eos: int


@dataclass(frozen=True, slots=True)
class SpeakerEncoderConfig:
    """ECAPA-TDNN over 128-bin log-mel frames of 24 kHz audio (speaker_encoder.py)."""
    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SpeakerEncoderConfig:
        known = {k: tuple(v) if isinstance(v, list) else v for k, v in doc.items()
                 if k in cls.__dataclass_fields__}
        cfg = cls(**known)
        if not len(cfg.enc_channels) == len(cfg.enc_kernel_sizes) == len(cfg.enc_dilations):
            raise ValueError("speaker_encoder_config: enc_channels, enc_kernel_sizes and "
                             "enc_dilations must have the same length")
        return cfg


@dataclass(frozen=True, slots=True)
class Qwen3TTSConfig:
    model_type: ModelType                  # tts_model_type: which of the three modes it serves
    talker: ModelConfig                    # the talker's decoder (codec vocabulary)
    code_predictor: ModelConfig
    num_code_groups: int
    text_vocab_size: int
    text_hidden_size: int
    codec: CodecIds
    tts_pad_token_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int
    tokenizer_type: str
    model_size: str                        # tts_model_size: "0b6" or "1b7"
    speakers: dict[str, int] = field(default_factory=dict, hash=False)       # name -> codec id
    speaker_dialects: dict[str, str] = field(default_factory=dict, hash=False)  # name -> dialect
    languages: dict[str, int] = field(default_factory=dict, hash=False)      # name -> codec id
    speaker_encoder: SpeakerEncoderConfig | None = None   # Base models only

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Qwen3TTSConfig:
        doc = json.loads((Path(path) / "config.json").read_text())
        if doc.get("model_type") != "qwen3_tts":
            raise ValueError(f"{path}: model_type {doc.get('model_type')!r} is not 'qwen3_tts'")
        return cls.from_json(doc)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Qwen3TTSConfig:
        talker = doc["talker_config"]
        cp = talker["code_predictor_config"]
        model_type = doc.get("tts_model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"tts_model_type {model_type!r}: expected one of {MODEL_TYPES}")
        if doc.get("tokenizer_type") != "qwen3_tts_tokenizer_12hz":
            raise NotImplementedError(f"tokenizer_type {doc.get('tokenizer_type')!r}: only the "
                                      "12 Hz speech tokenizer is supported")
        groups = talker["num_code_groups"]
        if cp.get("num_code_groups", groups) != groups:
            raise ValueError(f"code_predictor_config.num_code_groups {cp['num_code_groups']} != "
                             f"talker_config.num_code_groups {groups}")
        for name, sub in (("talker_config", talker), ("code_predictor_config", cp)):
            if sub.get("hidden_act", "silu") != "silu":
                raise ValueError(f"{name}.hidden_act {sub['hidden_act']!r}: only 'silu'")
            if sub.get("use_sliding_window"):
                raise NotImplementedError(f"{name}.use_sliding_window is not supported")
        eos = talker["codec_eos_token_id"]
        spk_enc = doc.get("speaker_encoder_config")
        return cls(
            model_type=model_type,
            talker=_decoder_config(doc, talker, "qwen3_tts_talker", (eos,)),
            code_predictor=_decoder_config(doc, cp, "qwen3_tts_talker_code_predictor", ()),
            num_code_groups=groups,
            text_vocab_size=talker["text_vocab_size"],
            text_hidden_size=talker["text_hidden_size"],
            codec=CodecIds(pad=talker["codec_pad_id"], bos=talker["codec_bos_id"], eos=eos,
                           think=talker["codec_think_id"], nothink=talker["codec_nothink_id"],
                           think_bos=talker["codec_think_bos_id"],
                           think_eos=talker["codec_think_eos_id"]),
            tts_pad_token_id=doc["tts_pad_token_id"], tts_bos_token_id=doc["tts_bos_token_id"],
            tts_eos_token_id=doc["tts_eos_token_id"], tokenizer_type=doc["tokenizer_type"],
            model_size=str(doc.get("tts_model_size") or ""),
            speakers={k.lower(): v for k, v in (talker.get("spk_id") or {}).items()},
            speaker_dialects={k.lower(): v for k, v in (talker.get("spk_is_dialect") or {}).items()
                              if v},
            languages={k.lower(): v for k, v in (talker.get("codec_language_id") or {}).items()},
            speaker_encoder=(SpeakerEncoderConfig.from_json(spk_enc)
                             if model_type == "base" and spk_enc is not None else None))

    @property
    def supported_languages(self) -> list[str]:
        """What a request may name: "auto" and every language but the dialects (which a
        preset speaker implies)."""
        return ["auto", *(name for name in self.languages if "dialect" not in name)]


def _decoder_config(doc: dict[str, Any], sub: dict[str, Any], model_type: str,
                    eos_token_ids: tuple[int, ...]) -> ModelConfig:
    """The talker's (or code predictor's) decoder: Qwen3's (q/k norm), its rotary plain 1-D.
    The talker's checkpoint declares 3-axis M-RoPE, but a TTS prompt is text only, whose
    three axes carry the same position (the reference's get_rope_index), which is 1-D RoPE."""
    num_heads = sub["num_attention_heads"]
    rope_theta = float(sub.get("rope_theta", 10000.0))
    scaling = dict(sub.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"{model_type}: rope_type {rope_type!r} is not supported")
    return ModelConfig(
        architecture="Qwen3TTSForConditionalGeneration",
        model_type=model_type,
        vocab_size=sub["vocab_size"],
        hidden_size=sub["hidden_size"],
        intermediate_size=sub["intermediate_size"],
        num_hidden_layers=sub["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=sub.get("num_key_value_heads") or num_heads,
        head_dim=sub.get("head_dim") or sub["hidden_size"] // num_heads,
        rms_norm_eps=sub.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=sub["max_position_embeddings"],
        attention_bias=bool(sub.get("attention_bias", False)),
        o_proj_bias=bool(sub.get("attention_bias", False)),
        has_qk_norm=True,
        torch_dtype=str(doc.get("dtype") or doc.get("torch_dtype") or "float32"),
        eos_token_ids=eos_token_ids,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )
