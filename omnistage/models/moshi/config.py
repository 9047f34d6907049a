"""Moshi's and Mimi's Hugging Face `config.json` as frozen records, read in one place each.

    MoshiConfig.from_pretrained(folder)      # folder of MoshiForConditionalGeneration
      .mimi      MimiConfig  (config.audio_encoder_config: the codec)
      .depth     DepthConfig (config.depth_decoder_config: the per-frame codebook transformer)
    MimiConfig.from_dict(config.json of a MimiModel folder)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _rope(doc: dict[str, Any]) -> dict[str, Any]:
    """HF 5.x `rope_parameters`, or the older top-level `rope_theta`."""
    rope = doc.get("rope_parameters") or {"rope_type": "default",
                                          "rope_theta": doc.get("rope_theta", 10000.0)}
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"rope_parameters {rope}: only the default rope")
    return dict(rope)


def _require(doc: dict[str, Any], where: str, **wanted: object) -> None:
    for key, want in wanted.items():
        if doc.get(key, want) != want:
            raise NotImplementedError(f"{where}.{key} {doc[key]!r}: only {want!r} is supported")


@dataclass(frozen=True, slots=True)
class MimiConfig:
    sampling_rate: int
    hidden_size: int
    num_filters: int
    num_residual_layers: int
    upsampling_ratios: tuple[int, ...]
    kernel_size: int
    last_kernel_size: int
    residual_kernel_size: int
    dilation_growth_rate: int
    compress: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope: dict[str, Any]
    max_position_embeddings: int
    sliding_window: int
    codebook_size: int
    codebook_dim: int               # the VQ space (vector_quantization_hidden_dimension)
    num_quantizers: int
    num_semantic_quantizers: int
    upsample_groups: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MimiConfig:
        _require(d, "mimi", use_causal_conv=True, pad_mode="constant", use_conv_shortcut=False,
                 hidden_act="gelu", audio_channels=1, trim_right_ratio=1.0, attention_bias=False)
        heads = d.get("num_attention_heads", 8)
        hidden = d.get("hidden_size", 512)
        return cls(
            sampling_rate=d.get("sampling_rate", 24000), hidden_size=hidden,
            num_filters=d.get("num_filters", 64),
            num_residual_layers=d.get("num_residual_layers", 1),
            upsampling_ratios=tuple(d.get("upsampling_ratios") or (8, 6, 5, 4)),
            kernel_size=d.get("kernel_size", 7), last_kernel_size=d.get("last_kernel_size", 3),
            residual_kernel_size=d.get("residual_kernel_size", 3),
            dilation_growth_rate=d.get("dilation_growth_rate", 2), compress=d.get("compress", 2),
            num_hidden_layers=d.get("num_hidden_layers", 8), num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            intermediate_size=d.get("intermediate_size", 2048), norm_eps=d.get("norm_eps", 1e-5),
            rope=_rope(d), max_position_embeddings=d.get("max_position_embeddings", 8000),
            sliding_window=d.get("sliding_window", 250),
            codebook_size=d.get("codebook_size", 2048),
            codebook_dim=d.get("vector_quantization_hidden_dimension", 256),
            num_quantizers=d.get("num_quantizers", 32),
            num_semantic_quantizers=d.get("num_semantic_quantizers", 1),
            upsample_groups=d.get("upsample_groups", 512))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> MimiConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))

    @property
    def hop_length(self) -> int:
        """Samples per SEANet latent (the encodec rate's hop)."""
        return math.prod(self.upsampling_ratios)

    @property
    def frame_size(self) -> int:
        """Samples per codec frame: the hop times the 2x down/upsampling (1920 at 24 kHz)."""
        return self.hop_length * 2

    @property
    def frame_rate(self) -> float:
        return self.sampling_rate / self.frame_size


@dataclass(frozen=True, slots=True)
class DepthConfig:
    hidden_size: int
    input_size: int                 # the temporal transformer's hidden size
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_dim: int
    rms_norm_eps: float
    vocab_size: int
    audio_vocab_size: int
    num_codebooks: int


@dataclass(frozen=True, slots=True)
class MoshiConfig:
    vocab_size: int
    audio_vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_dim: int
    rms_norm_eps: float
    rope: dict[str, Any]
    max_position_embeddings: int
    num_codebooks: int
    mimi: MimiConfig
    depth: DepthConfig

    @classmethod
    def from_pretrained(cls, path: str | Path) -> MoshiConfig:
        d = json.loads((Path(path) / "config.json").read_text())
        _require(d, "moshi", hidden_act="silu")
        mimi = MimiConfig.from_dict(d["audio_encoder_config"])
        heads = d.get("num_attention_heads", 32)
        audio_vocab = d.get("audio_vocab_size") or mimi.codebook_size
        k = d.get("num_codebooks", 8)
        if k > mimi.num_quantizers:
            raise ValueError(f"num_codebooks {k} > the codec's num_quantizers "
                             f"{mimi.num_quantizers}")
        dd = d["depth_decoder_config"]
        _require(dd, "depth_decoder_config", hidden_act="silu")
        dheads = dd.get("num_attention_heads", 16)
        depth = DepthConfig(
            hidden_size=dd["hidden_size"], input_size=d["hidden_size"],
            num_hidden_layers=dd["num_hidden_layers"], num_attention_heads=dheads,
            num_key_value_heads=dd.get("num_key_value_heads") or dheads,
            head_dim=dd.get("head_dim") or dd["hidden_size"] // dheads, ffn_dim=dd["ffn_dim"],
            rms_norm_eps=dd.get("rms_norm_eps", 1e-8), vocab_size=d["vocab_size"],
            audio_vocab_size=audio_vocab, num_codebooks=k)
        return cls(
            vocab_size=d["vocab_size"], audio_vocab_size=audio_vocab, hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads, ffn_dim=d["ffn_dim"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-8), rope=_rope(d),
            max_position_embeddings=d.get("max_position_embeddings", 3000), num_codebooks=k,
            mimi=mimi, depth=depth)
