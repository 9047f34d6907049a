"""Qwen3-TTS's 12 Hz speech tokenizer, decoder side: codec frames -> 24 kHz waveform.

Qwen3-Omni's code2wav (qwen3_omni/code2wav.py) with three differences, which is why it is a
subclass: the frames are embedded by the codec's split residual quantizer (codebook 0 and
codebooks 1.. each summed and projected by a 1x1 conv) and a causal conv (k = 3) into
`latent_dim`; the pre-transformer projects latent -> hidden -> latent around its layers; and
the decoder's transposed convs trim only their right end, so the whole decoder is causal and a
decode of T frames is exactly T * total_upsample samples (none held back).

    codes (B, Q, T) ─ quantizer: sum_q codebook_q[code] per half, 1x1 conv ─> (B, C, T)
      ─ pre_conv (causal, k = 3) ─> (B, latent, T) ─ input_proj, sliding-window transformer,
        output_proj ─> (B, T, latent) ─ Qwen3-Omni's vocoder ─> wav (B, 1, T * U)

Streaming (qwen3_omni/code2wav_stream.py, exact seams) works unchanged: a stream keeps the two
frames before each chunk for the pre_conv (`embed_context`; code -1, whose vector is zero,
stands before the first frame, which is the conv's zero padding). Module names follow the
checkpoint's `decoder.*` tensors of `speech_tokenizer/model.safetensors`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.linear import Linear
from omnistage.models.qwen3_omni.code2wav import (CausalConv1d, Code2Wav, Code2WavConfig,
                                                  Code2WavTransformer)

CHECKPOINT_PREFIX = "decoder."
# the quantizer's encode-side projections, which decoding never uses
ENCODE_ONLY = ("quantizer.rvq_first.input_proj", "quantizer.rvq_rest.input_proj")


@dataclass(frozen=True, slots=True)
class SpeechDecoderConfig(Code2WavConfig):
    latent_dim: int = 1024
    codebook_dim: int = 512

    @classmethod
    def from_pretrained(cls, path: str | Path) -> SpeechDecoderConfig:
        """From the speech tokenizer's config.json (`decoder_config`)."""
        doc = json.loads((Path(path) / "config.json").read_text())
        if doc.get("model_type") != "qwen3_tts_tokenizer_12hz":
            raise NotImplementedError(f"{path}: speech tokenizer {doc.get('model_type')!r}; "
                                      "only qwen3_tts_tokenizer_12hz is supported")
        d = doc["decoder_config"]
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"decoder_config.hidden_act {d['hidden_act']!r}: only 'silu'")
        heads = d["num_attention_heads"]
        cfg = cls(
            codebook_size=d["codebook_size"], num_quantizers=d["num_quantizers"],
            hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            intermediate_size=d["intermediate_size"], attention_bias=d["attention_bias"],
            sliding_window=d["sliding_window"], rms_norm_eps=d["rms_norm_eps"],
            max_position_embeddings=d["max_position_embeddings"],
            rope_parameters={"rope_type": "default", "rope_theta": float(d["rope_theta"])},
            upsample_rates=tuple(d["upsample_rates"]),
            upsampling_ratios=tuple(d["upsampling_ratios"]), decoder_dim=d["decoder_dim"],
            latent_dim=d["latent_dim"], codebook_dim=d["codebook_dim"],
            sample_rate=doc.get("output_sample_rate", 24000))
        if cfg.total_upsample != doc.get("decode_upsample_rate", cfg.total_upsample):
            raise ValueError(f"decode_upsample_rate {doc['decode_upsample_rate']} != the "
                             f"decoder's upsampling {cfg.total_upsample}")
        return cfg

    def num_samples(self, num_frames: int) -> int:
        """Every frame gives `total_upsample` samples (the transposed convs trim one side)."""
        return num_frames * math.prod(self.upsample_rates + self.upsampling_ratios)


class Codebook(nn.Module):
    """One codebook, stored as the reference trains it: vectors = embedding_sum / usage."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def forward(self, codes: Tensor) -> Tensor:                  # (B, T) -> (B, T, D)
        vectors = self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]
        return F.embedding(codes.clamp(min=0), vectors) * (codes >= 0)[..., None]  # -1: zero


class CodebookLayer(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = Codebook(size, dim)


class CodebookStack(nn.Module):
    def __init__(self, num: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CodebookLayer(size, dim) for _ in range(num))


class ResidualQuantizer(nn.Module):
    """Decode side of one residual VQ: the sum of its codebooks' vectors, projected (1x1 conv,
    no bias) from codebook_dim / 2 to codebook_dim."""

    def __init__(self, num: int, cfg: SpeechDecoderConfig) -> None:
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.vq = CodebookStack(num, cfg.codebook_size, dim)
        self.output_proj = nn.Conv1d(dim, cfg.codebook_dim, 1, bias=False)

    def forward(self, codes: Tensor) -> Tensor:                  # (B, K, T) -> (B, C, T)
        total = torch.zeros((), dtype=self.output_proj.weight.dtype, device=codes.device)
        for k, layer in enumerate(self.vq.layers):
            total = total + layer._codebook(codes[:, k]).transpose(1, 2)
        return self.output_proj(total)


class SplitResidualQuantizer(nn.Module):
    """Codebook 0 (semantic) and codebooks 1.. (acoustic), each its own residual VQ."""

    def __init__(self, cfg: SpeechDecoderConfig) -> None:
        super().__init__()
        self.rvq_first = ResidualQuantizer(1, cfg)
        self.rvq_rest = ResidualQuantizer(cfg.num_quantizers - 1, cfg)

    def forward(self, codes: Tensor) -> Tensor:                  # (B, Q, T) -> (B, C, T)
        return self.rvq_first(codes[:, :1]) + self.rvq_rest(codes[:, 1:])


class SpeechDecoderTransformer(Code2WavTransformer):
    """Qwen3-Omni's pre-transformer between latent -> hidden and hidden -> latent."""

    def __init__(self, cfg: SpeechDecoderConfig) -> None:
        super().__init__(cfg)
        self.input_proj = Linear(cfg.latent_dim, cfg.hidden_size, bias=True)
        self.output_proj = Linear(cfg.hidden_size, cfg.latent_dim, bias=True)

    def forward(self, h: Tensor) -> Tensor:                       # (B, T, latent)
        return self.output_proj(super().forward(self.input_proj(h)))

    def forward_cached(self, h: Tensor, past: Tensor, num_past: Tensor, num_new: Tensor
                       ) -> tuple[Tensor, Tensor]:
        rows, caches = super().forward_cached(self.input_proj(h), past, num_past, num_new)
        return self.output_proj(rows), caches


class Qwen3TTSSpeechDecoder(Code2Wav):
    embed_context = 2          # the pre_conv's reach (k = 3)
    trim_left = False
    cfg: SpeechDecoderConfig

    def build_embedding(self, cfg: SpeechDecoderConfig) -> None:  # type: ignore[override]
        self.quantizer = SplitResidualQuantizer(cfg)
        self.pre_conv = CausalConv1d(cfg.codebook_dim, cfg.latent_dim, 3)

    def build_transformer(self, cfg: SpeechDecoderConfig  # type: ignore[override]
                          ) -> SpeechDecoderTransformer:
        return SpeechDecoderTransformer(cfg)

    @property
    def row_size(self) -> int:
        return self.cfg.latent_dim

    def embed(self, codes: Tensor) -> Tensor:
        """codes (B, Q, T) -> (B, T, latent); code -1 embeds as the conv's zero padding."""
        return self.pre_conv(self.quantizer(codes)).transpose(1, 2)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None, prefix: str = CHECKPOINT_PREFIX
                        ) -> Qwen3TTSSpeechDecoder:
        """From the speech tokenizer's folder (a Qwen3-TTS checkpoint's `speech_tokenizer/`),
        strictly; dtype None: the checkpoint's."""
        path = Path(path)
        model = cls.load(path, SpeechDecoderConfig.from_pretrained(path), prefix, device,
                         dtype, exclude=ENCODE_ONLY)
        assert isinstance(model, Qwen3TTSSpeechDecoder)
        return model
