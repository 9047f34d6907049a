"""Qwen3-TTS's 12 Hz speech tokenizer, encoder side: 24 kHz reference audio -> codec frames
(T, Q), what an in-context voice clone puts in the talker's prompt. The reference's encoder is
transformers' `MimiModel` (its encode path, transformers 4.57.3), here in plain PyTorch with
module names following the checkpoint's `encoder.*` tensors:

    wav (B, 1, N) ─ SEANet: causal convs (ELU), per ratio a residual block + strided conv
      ─> (B, hidden, N / 960) ─ transformer: causal attention over the whole clip (4.57's Mimi
        builds a full causal mask; `sliding_window` is not applied), LayerNorm, GELU MLP,
        layer-scaled residuals ─ downsample: strided conv (replicate padding) ─> 12.5 Hz
      ─ split residual VQ: codebook 0 (semantic) and 1.. (acoustic), each nearest-vector
        residual search after a 1x1 input projection ─> codes (B, Q, T)

A clip of N samples keeps its first ceil(N / 1920) frames, as the reference does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.linear import Linear
from omnistage.layers.rotary import RotaryEmbedding, get_rope
from omnistage.models.loader import load_component
from omnistage.models.qwen3_omni.code2wav_transformer import LayerScale

CHECKPOINT_PREFIX = "encoder."
# decode-side tensors of the Mimi checkpoint, which encoding never reads
DECODE_ONLY = ("quantizer.semantic_residual_vector_quantizer.output_proj",
               "quantizer.acoustic_residual_vector_quantizer.output_proj")


@dataclass(frozen=True, slots=True)
class SpeechEncoderConfig:
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
    rope_theta: float
    max_position_embeddings: int
    codebook_size: int
    codebook_dim: int
    num_semantic_quantizers: int
    num_quantizers: int             # what the talker reads (encoder_valid_num_quantizers)
    downsample_rate: int            # samples per frame (1920)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> SpeechEncoderConfig:
        doc = json.loads((Path(path) / "config.json").read_text())
        m: dict[str, Any] = doc["encoder_config"]
        for key, want in (("use_causal_conv", True), ("pad_mode", "constant"),
                          ("use_conv_shortcut", False), ("hidden_act", "gelu"),
                          ("audio_channels", 1)):
            if m.get(key, want) != want:
                raise NotImplementedError(f"encoder_config.{key} {m[key]!r}: only {want!r}")
        fields = {k: m[k] for k in cls.__dataclass_fields__ if k in m}
        heads = m["num_attention_heads"]
        fields.update(
            upsampling_ratios=tuple(m["upsampling_ratios"]),
            head_dim=m.get("head_dim") or m["hidden_size"] // heads,
            codebook_dim=m.get("vector_quantization_hidden_dimension") or m["codebook_dim"],
            num_key_value_heads=m.get("num_key_value_heads") or heads,
            num_quantizers=doc.get("encoder_valid_num_quantizers", m["num_quantizers"]),
            downsample_rate=doc.get("encode_downsample_rate", 1920))
        return cls(**fields)


class CausalConv(nn.Module):
    """Mimi's causal conv: left padding `(k - 1) * dilation + 1 - stride`, and on the right
    what completes the last stride (zeros, or the edge sample with `replicate`)."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int = 1,
                 dilation: int = 1, bias: bool = True, mode: str = "constant") -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel, stride, dilation=dilation, bias=bias)
        self.kernel = (kernel - 1) * dilation + 1
        self.stride = stride
        self.mode = mode

    def forward(self, x: Tensor) -> Tensor:                       # (B, C, L)
        pad = self.kernel - self.stride
        length = x.shape[-1]
        frames = math.ceil((length - self.kernel + pad) / self.stride + 1) - 1
        extra = frames * self.stride + self.kernel - pad - length
        return self.conv(F.pad(x, (pad, extra), mode=self.mode))


class ResnetBlock(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig, dim: int, dilation: int) -> None:
        super().__init__()
        hidden = dim // cfg.compress
        self.block = nn.ModuleList([
            nn.ELU(), CausalConv(dim, hidden, cfg.residual_kernel_size, dilation=dilation),
            nn.ELU(), CausalConv(hidden, dim, 1)])

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        return x + h


class SEANetEncoder(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = [CausalConv(1, cfg.num_filters, cfg.kernel_size)]
        dim = cfg.num_filters
        for ratio in reversed(cfg.upsampling_ratios):
            layers += [ResnetBlock(cfg, dim, cfg.dilation_growth_rate ** j)
                       for j in range(cfg.num_residual_layers)]
            layers += [nn.ELU(), CausalConv(dim, dim * 2, ratio * 2, stride=ratio)]
            dim *= 2
        layers += [nn.ELU(), CausalConv(dim, cfg.hidden_size, cfg.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor) -> Tensor:                       # (B, 1, N) -> (B, H, L)
        for layer in self.layers:
            x = layer(x)
        return x


class EncoderAttention(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size)
        self.rotary = rotary

    def forward(self, x: Tensor) -> Tensor:                       # (B, T, hidden)
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(torch.arange(t, device=x.device), q, k)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=self.num_kv_heads != self.num_heads)      # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class EncoderMLP(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = EncoderAttention(cfg, rotary)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = EncoderMLP(cfg)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(self, h: Tensor) -> Tensor:
        h = h + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(h)))
        return h + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(h)))


class EncoderTransformer(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        rotary = get_rope(cfg.head_dim, cfg.max_position_embeddings,
                          {"rope_type": "default", "rope_theta": cfg.rope_theta})
        self.layers = nn.ModuleList(EncoderLayer(cfg, rotary)
                                    for _ in range(cfg.num_hidden_layers))

    def forward(self, h: Tensor) -> Tensor:                       # (B, T, hidden)
        for layer in self.layers:
            h = layer(h)
        return h


class NearestCodebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embed_sum = nn.Parameter(torch.zeros(size, dim))

    def vectors(self) -> Tensor:
        return self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (B, D, T) -> nearest codes (B, T) and their vectors (B, D, T)."""
        vectors = self.vectors()
        flat = x.transpose(1, 2).reshape(-1, x.shape[1])
        codes = torch.cdist(flat[None].float(), vectors[None].float(), p=2)[0].argmin(-1)
        codes = codes.view(x.shape[0], x.shape[2])
        return codes, F.embedding(codes, vectors).transpose(1, 2)


class CodebookSlot(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.codebook = NearestCodebook(size, dim)


class ResidualEncoderVQ(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig, num: int) -> None:
        super().__init__()
        self.input_proj = nn.Conv1d(cfg.hidden_size, cfg.codebook_dim, 1, bias=False)
        self.layers = nn.ModuleList(CodebookSlot(cfg.codebook_size, cfg.codebook_dim)
                                    for _ in range(num))

    def forward(self, x: Tensor) -> Tensor:                       # (B, H, T) -> (B, K, T)
        residual = self.input_proj(x)
        codes = []
        for layer in self.layers:
            code, vector = layer.codebook(residual)
            residual = residual - vector
            codes.append(code)
        return torch.stack(codes, dim=1)


class SplitEncoderVQ(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        semantic = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualEncoderVQ(cfg, semantic)
        self.acoustic_residual_vector_quantizer = ResidualEncoderVQ(
            cfg, cfg.num_quantizers - semantic)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.semantic_residual_vector_quantizer(x),
                          self.acoustic_residual_vector_quantizer(x)], dim=1)


class Qwen3TTSSpeechEncoder(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = SEANetEncoder(cfg)
        self.encoder_transformer = EncoderTransformer(cfg)
        rate = cfg.downsample_rate // math.prod(cfg.upsampling_ratios)    # 25 Hz -> 12.5 Hz
        self.downsample = CausalConv(cfg.hidden_size, cfg.hidden_size, 2 * rate, stride=rate,
                                     bias=False, mode="replicate")
        self.quantizer = SplitEncoderVQ(cfg)

    @torch.inference_mode()
    def encode(self, wav: Tensor) -> Tensor:
        """24 kHz audio (N,) -> its frames (ceil(N / 1920), Q)."""
        w = self.downsample.conv.weight
        h = self.encoder(wav.to(w.device, w.dtype)[None, None])          # (1, H, L)
        h = self.encoder_transformer(h.transpose(1, 2)).transpose(1, 2)
        codes = self.quantizer(self.downsample(h))[0]                     # (Q, T)
        return codes[:, :math.ceil(wav.shape[-1] / self.cfg.downsample_rate)].T

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> Qwen3TTSSpeechEncoder:
        """From the speech tokenizer's folder, strictly (Mimi's decode-side tensors and
        `initialized` flags aside); dtype None: the checkpoint's."""
        cfg = SpeechEncoderConfig.from_pretrained(path)
        model = load_component(lambda: cls(cfg), Path(path), CHECKPOINT_PREFIX, device, dtype,
                               {}, DECODE_ONLY, ignore_suffixes=(".initialized",))
        return model.requires_grad_(False)
