"""Qwen3-Omni code2wav's sizes (`Code2WavConfig`, from the checkpoint's `code2wav_config`) and
the arithmetic of its output length and receptive field that chunked and streamed decoding
rely on (code2wav.py explains both)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from transformers import PretrainedConfig

CHECKPOINT_PREFIX = "code2wav."


@dataclass(frozen=True, slots=True)
class Code2WavConfig:
    codebook_size: int = 2048
    num_quantizers: int = 16
    hidden_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    intermediate_size: int = 3072
    attention_bias: bool = False
    sliding_window: int = 72
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8000
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)      # decoder blocks
    upsampling_ratios: tuple[int, ...] = (2, 2)         # ConvNeXt upsampling after the transformer
    decoder_dim: int = 1536
    sample_rate: int = 24000

    @classmethod
    def from_hf(cls, hf: PretrainedConfig) -> Code2WavConfig:
        """From the checkpoint's `Qwen3OmniMoeConfig` or its `code2wav_config`."""
        hf = getattr(hf, "code2wav_config", hf)
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"code2wav_config.hidden_act {act!r}: only 'silu' is supported")
        rope = dict(getattr(hf, "rope_parameters", None)
                    or {"rope_type": "default", "rope_theta": getattr(hf, "rope_theta", 10000.0)})
        return cls(
            codebook_size=hf.codebook_size, num_quantizers=hf.num_quantizers,
            hidden_size=hf.hidden_size, num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=hf.num_key_value_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            intermediate_size=hf.intermediate_size, attention_bias=hf.attention_bias,
            sliding_window=hf.sliding_window, rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings, rope_parameters=rope,
            upsample_rates=tuple(hf.upsample_rates),
            upsampling_ratios=tuple(hf.upsampling_ratios), decoder_dim=hf.decoder_dim)

    @property
    def total_upsample(self) -> int:
        """Samples per codec frame (1920 for the real model: 24 kHz at 12.5 Hz)."""
        return math.prod(self.upsample_rates + self.upsampling_ratios)

    @property
    def receptive_field_frames(self) -> int:
        """Left context (frames) a streamed window needs for its samples to equal the whole
        decode's: an upper bound on how far back the convolutional part reaches, plus the
        frame whose samples a window recomputes for its predecessor, plus rounding slack (12
        for the real model). The sliding-window transformer needs none: a stream keeps its
        keys and values (`Code2WavStream`)."""
        reach, rate = 0.0, 1                      # samples back / samples per frame, summed
        for ratio in self.upsampling_ratios:
            rate *= ratio
            reach += 6 / rate                     # ConvNeXt's causal depthwise conv, k = 7
        reach += 6 / rate                         # the decoder's first causal conv, k = 7
        for r in self.upsample_rates:             # transposed convs look ahead, never back;
            rate *= r                             # three residual units, k = 7, dilations
            reach += (6 * (1 + 3 + 9) + r) / rate  # 1 / 3 / 9, + flooring at the upsampling
        reach += 6 / rate                         # the last causal conv, k = 7
        return math.ceil(reach) + 1 + 1           # + the recomputed frame, + rounding slack

    def num_samples(self, num_frames: int) -> int:
        """Waveform length of one decode of `num_frames` frames (each decoder block's
        transposed conv, k = 2s trimmed by s on both sides, maps L to (L - 1) * s)."""
        length = num_frames * math.prod(self.upsampling_ratios)
        for rate in self.upsample_rates:
            length = (length - 1) * rate
        return length


def check_chunking(cfg: Code2WavConfig, chunk_size: int, left_context: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size {chunk_size}: must be at least 1")
    if left_context < 0:
        raise ValueError(f"left_context {left_context}: must be >= 0")
    if chunk_size + left_context > cfg.max_position_embeddings:
        raise ValueError(f"chunk_size {chunk_size} + left_context {left_context} exceed "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
