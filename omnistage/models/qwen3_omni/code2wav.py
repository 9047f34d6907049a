"""Qwen3-Omni code2wav: codec frames -> 24 kHz waveform, whole, chunked, or streamed.

HF's `Qwen3OmniMoeCode2Wav` in plain PyTorch; module names follow the checkpoint's
`code2wav.*` tensors one-to-one (q/k/v and gate/up are fused on load), numerics follow
`modeling_qwen3_omni_moe.py` op for op.

    codes (B, Q, T) ─ embed(code + q * codebook_size), mean over Q ─> (B, T, hidden)
      ─ pre-transformer: sliding-window causal attention + SwiGLU, layer-scaled residuals
      ─ upsample: per ratio, causal transposed conv (k = s = ratio) + causal ConvNeXt block
      ─ decoder: causal conv -> per rate, SnakeBeta + causal transposed conv (k = 2s) + three
        dilated residual units -> SnakeBeta -> causal conv to 1 channel -> clamp to [-1, 1]
      ─> wav (B, 1, T * total_upsample - num_lost)

Every layer is causal except the decoder's transposed convs (k = 2s), which trim `k - s`
samples on both sides: each output sample then mixes its own input step with the next one,
and the last `s` samples (which the missing next step would complete) are dropped. So each
decode of T frames yields `num_samples(T)` = T * total_upsample - num_lost samples, and
samples never depend on frames to their right beyond what the trimming keeps. Two
consequences used below:

- Chunked decode (HF's `chunked_decode`, used by `generate(return_audio=True)` with chunk 300,
  left context 25) decodes `| ctx | chunk |` windows and keeps the chunk's samples:

      frames   | chunk 0      | chunk 1      | chunk 2 |
      window 1        | ctx   | chunk 1      |            ctx = min(left_context, start)
      samples  keep wav[ctx * total_upsample : num_samples(ctx + n)]

- Right padding is harmless: a window padded on the right with any codes gives the same first
  `num_samples(n)` samples, so windows of different lengths batch into one forward
  (`vocode_windows`), e.g. one request's first chunk (no context) with others' later ones.

HF's chunked decode keeps `num_samples(ctx + n) - ctx * U` samples of each window, so every
chunk boundary drops `num_lost` samples (555 at 24 kHz) and shifts all audio after it;
`generate(return_audio=True)` only avoids that by decoding up to 300 frames (24 s) in one
window. `Code2WavStream` (code2wav_stream.py), the per-request state of the serving stage,
streams exactly: the transformer continues from kept keys and values, each vocoder window's
last `num_lost` samples are held back and recomputed by the next window, and the
concatenated output is the whole decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig

from omnistage.layers.linear import Linear, MergedLinear, QKVLinear
from omnistage.layers.norm import RMSNorm
from omnistage.layers.rotary import RotaryEmbedding, get_rope, rotate_half
from omnistage.models.loader import load_component

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


# ---- convolutions and activations -----------------------------------------------------------

class CausalConv1d(nn.Module):
    """Stride-1 conv padded on the left only: output t sees inputs t - (k-1)*dilation .. t."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, dilation: int = 1,
                 groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel_size, dilation=dilation, groups=groups)
        self.left_pad = (kernel_size - 1) * dilation

    def forward(self, x: Tensor) -> Tensor:                       # (B, C, L) -> (B, C', L)
        return self.conv(F.pad(x, (self.left_pad, 0)))


class CausalConvTranspose1d(nn.Module):
    """Transposed conv with `kernel - stride` samples cut from both ends:
    L -> (L - 1) * stride + 2 * stride - kernel; or, `trim_left` False (Qwen3-TTS's decoder),
    from the right end only: L -> L * stride, and output t sees inputs up to t // stride."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int,
                 trim_left: bool = True) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_ch, out_ch, kernel_size, stride=stride)
        self.trim = kernel_size - stride
        self.left = self.trim if trim_left else 0

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv(x)                                          # (B, C', (L-1)*s + k)
        return y[..., self.left:y.shape[-1] - self.trim]


class SnakeBeta(nn.Module):
    """x + sin(x * e^alpha)^2 / e^beta, per channel (alpha, beta stored as logs)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor) -> Tensor:                       # (B, C, L)
        alpha = self.alpha.exp()[None, :, None]
        inv_beta = 1.0 / (self.beta.exp()[None, :, None] + 1e-9)
        return x + inv_beta * torch.sin(x * alpha).pow(2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:                       # (B, C, L)
        h = self.norm(self.dwconv(x).transpose(1, 2))             # (B, L, C)
        h = self.pwconv2(F.gelu(self.pwconv1(h)))                 # (B, L, 4C) -> (B, L, C)
        return x + (self.gamma * h).transpose(1, 2)


class DecoderResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    """SnakeBeta, upsampling by `rate` (in_dim -> in_dim / 2 channels), residual units."""

    def __init__(self, in_dim: int, rate: int, trim_left: bool = True) -> None:
        super().__init__()
        out_dim = in_dim // 2
        self.block = nn.ModuleList([SnakeBeta(in_dim),
                                    CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate,
                                                          trim_left),
                                    *(DecoderResidualUnit(out_dim, d) for d in (1, 3, 9))])

    def forward(self, x: Tensor) -> Tensor:                       # (B, C, L) -> (B, C/2, (L-1)*r)
        for layer in self.block:
            x = layer(x)
        return x


# ---- pre-transformer ------------------------------------------------------------------------

class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class Code2WavAttention(nn.Module):
    def __init__(self, cfg: Code2WavConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.qkv_sizes = [self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2]
        self.qkv_proj = QKVLinear(cfg.hidden_size, self.head_dim, self.num_heads,
                                  self.num_kv_heads, bias=cfg.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size,
                             bias=cfg.attention_bias)
        self.rotary = rotary

    def forward(self, positions: Tensor, x: Tensor, mask: Tensor) -> Tensor:
        B, T, _ = x.shape                                         # x: (B, T, hidden)
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim)           # (B, T, H, D)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)        # (B, T, Hkv, D)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            enable_gqa=self.num_kv_heads != self.num_heads)       # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def forward_cached(self, x: Tensor, past_k: Tensor, past_v: Tensor, q_pos: Tensor,
                       k_pos: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """New rows x (B, N, hidden) after P cached ones (past_k / past_v (B, P, Hkv, D), not
        rotated): -> out (B, N, hidden), and the keys / values of all P + N rows, unrotated,
        for the next call's cache. Rotation uses positions relative to the cache's start,
        which only relative offsets reach."""
        B, N, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = q.view(B, N, self.num_heads, self.head_dim)           # (B, N, H, D)
        k_all = torch.cat([past_k, k.view(B, N, self.num_kv_heads, self.head_dim)], 1)
        v_all = torch.cat([past_v, v.view(B, N, self.num_kv_heads, self.head_dim)], 1)
        out = F.scaled_dot_product_attention(
            _rotate(self.rotary, q, q_pos).transpose(1, 2),
            _rotate(self.rotary, k_all, k_pos).transpose(1, 2), v_all.transpose(1, 2),
            attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)   # (B, H, N, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, N, -1)), k_all, v_all


def _rotate(rotary: RotaryEmbedding, x: Tensor, positions: Tensor) -> Tensor:
    """x (B, T, heads, D) rotated for `positions` (T,), as `RotaryEmbedding.forward` does."""
    cos = rotary.cos_cache[positions].unsqueeze(1).to(x.dtype)   # (T, 1, D)
    sin = rotary.sin_cache[positions].unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Code2WavMLP(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)          # (B, T, I) each
        return self.down_proj(F.silu(gate) * up)


class Code2WavTransformerLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Code2WavAttention(cfg, rotary)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = Code2WavMLP(cfg)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(self, positions: Tensor, h: Tensor, mask: Tensor) -> Tensor:
        h = h + self.self_attn_layer_scale(self.self_attn(positions, self.input_layernorm(h), mask))
        return h + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(h)))

    def forward_cached(self, h: Tensor, past_k: Tensor, past_v: Tensor, q_pos: Tensor,
                       k_pos: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        attn, k_all, v_all = self.self_attn.forward_cached(
            self.input_layernorm(h), past_k, past_v, q_pos, k_pos, mask)
        h = h + self.self_attn_layer_scale(attn)
        return h + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(h))), k_all, v_all


class Code2WavTransformer(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.sliding_window = cfg.sliding_window
        rotary = get_rope(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_parameters)
        self.layers = nn.ModuleList(Code2WavTransformerLayer(cfg, rotary)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, h: Tensor) -> Tensor:                       # (B, T, hidden)
        T = h.shape[1]
        positions = torch.arange(T, device=h.device)              # every window starts at 0
        offset = positions[:, None] - positions[None, :]          # (T, T): query - key
        mask = (offset >= 0) & (offset < self.sliding_window)     # causal, `window` keys wide
        for layer in self.layers:
            h = layer(positions, h, mask)
        return self.norm(h)

    @property
    def num_cached(self) -> int:
        """Rows of keys / values a stream keeps: all a new row's window reaches back."""
        return self.sliding_window - 1

    def forward_cached(self, h: Tensor, past: Tensor, num_past: Tensor, num_new: Tensor
                       ) -> tuple[Tensor, Tensor]:
        """Streams continued: new rows h (B, N, hidden), right-padded (num_new (B,) real),
        after each stream's cache `past` (B, layers, 2, P, Hkv, D) whose last num_past (B,)
        rows are real (P = num_cached). Every layer sees exactly the keys the whole decode
        would, so the rows equal the whole decode's. -> (B, N, hidden) normed, and the new
        caches (the last P real rows of each stream, right-aligned as `past`).

            key slots   | cache: P rows (the last num_past real) | new: N rows (num_new real) |
            query j     at slot P + j: sees slots j .. P + j that are real
        """
        B, N, _ = h.shape
        P, dev = self.num_cached, h.device
        slots = torch.arange(P + N, device=dev)
        q_idx = torch.arange(N, device=dev)
        mask = (slots[None, :] <= P + q_idx[:, None]) & (slots[None, :] >= q_idx[:, None])
        real = (slots[None, :] >= P) | (slots[None, :] >= P - num_past[:, None])   # (B, P + N)
        mask = (mask[None] & real[:, None])[:, None]               # (B, 1, N, P + N)
        keep = (num_new[:, None] + torch.arange(P, device=dev)[None])   # (B, P): last P real
        keep = keep[:, :, None, None]
        caches = []
        for i, layer in enumerate(self.layers):
            h, k_all, v_all = layer.forward_cached(h, past[:, i, 0], past[:, i, 1],
                                                   slots[P:], slots, mask)
            idx = keep.expand(-1, -1, *k_all.shape[2:])
            caches.append(torch.stack([k_all.gather(1, idx), v_all.gather(1, idx)], 1))
        return self.norm(h), torch.stack(caches, 1)


# ---- model ----------------------------------------------------------------------------------

class Code2Wav(nn.Module):
    # checkpoint name -> (our fused parameter, shard id); read by the weight loader
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    # frames of codes before a chunk that its embedding reaches back to (Qwen3-TTS: a causal
    # conv), which a stream keeps; code -1 stands for "before the start" (zero padding)
    embed_context = 0
    trim_left = True                 # the transposed convs' trim (CausalConvTranspose1d)

    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.total_upsample = cfg.total_upsample
        self.build_embedding(cfg)
        self.pre_transformer = self.build_transformer(cfg)
        self.upsample, self.decoder = vocoder_layers(cfg, self.row_size, self.trim_left)

    def build_embedding(self, cfg: Code2WavConfig) -> None:
        h = cfg.hidden_size
        num_codes = cfg.codebook_size * cfg.num_quantizers
        self.code_embedding = nn.Embedding(num_codes, h, _weight=torch.empty(num_codes, h))

    def build_transformer(self, cfg: Code2WavConfig) -> Code2WavTransformer:
        return Code2WavTransformer(cfg)

    @property
    def row_size(self) -> int:
        """Width of the pre-transformer's output rows, which the vocoder takes."""
        return self.cfg.hidden_size

    @property
    def device(self) -> torch.device:
        return self.decoder[-1].conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder[-1].conv.weight.dtype

    @property
    def num_lost(self) -> int:
        """Samples a decode yields fewer than frames * total_upsample."""
        return self.total_upsample - self.cfg.num_samples(1)

    def forward(self, codes: Tensor) -> Tensor:
        """Unchecked decode: codes (B, Q, T) -> wav (B, 1, num_samples(T))."""
        return self.vocode(self.pre_transformer(self.embed(codes)))

    def continue_rows(self, codes: Tensor, past: Tensor, num_past: Tensor, num_new: Tensor
                      ) -> tuple[Tensor, Tensor]:
        """Streams' pre-transformer continued over new frames: codes (B, Q, embed_context + N)
        (the frames the embedding reaches back to, then the N new ones, right-padded) ->
        `Code2WavTransformer.forward_cached`'s rows (B, N, row_size) and caches."""
        return self.pre_transformer.forward_cached(self.embed(codes)[:, self.embed_context:],
                                                   past, num_past, num_new)

    def embed(self, codes: Tensor) -> Tensor:
        """codes (B, Q, T) -> (B, T, hidden): each frame's codebook embeddings averaged."""
        cfg = self.cfg
        offsets = torch.arange(cfg.num_quantizers, device=codes.device) * cfg.codebook_size
        return self.code_embedding(codes + offsets[:, None]).mean(1)  # (B, Q, T, hid) -> mean

    def vocode(self, h: Tensor) -> Tensor:
        """The convolutional part: pre-transformer rows (B, T, hidden) -> wav (B, 1,
        num_samples(T)), clamped to [-1, 1]."""
        h = h.transpose(1, 2)                                     # (B, hidden, T)
        for up_conv, convnext in self.upsample:
            h = convnext(up_conv(h))                              # (B, hidden, T * ratio)
        for layer in self.decoder:
            h = layer(h)                                          # ... -> (B, 1, num_samples(T))
        return h.clamp(-1.0, 1.0)

    @torch.inference_mode()
    def decode(self, codes: Tensor) -> Tensor:
        """codes (B, num_quantizers, T) -> wav (B, 1, T * total_upsample - num_lost), as HF's
        `code2wav(codes)`."""
        self.check_codes(codes, "codes", batched=True)
        return self(codes.to(self.device))

    @torch.inference_mode()
    def chunked_decode(self, codes: Tensor, chunk_size: int = 300, left_context_size: int = 25
                       ) -> Tensor:
        """As HF's `chunked_decode`: windows of `chunk_size` frames, each decoded with up to
        `left_context_size` earlier frames, context samples dropped; (B, 1, samples)."""
        self.check_codes(codes, "codes", batched=True)
        check_chunking(self.cfg, chunk_size, left_context_size)
        codes = codes.to(self.device)
        wavs = []
        for start in range(0, codes.shape[-1], chunk_size):
            ctx = min(left_context_size, start)
            wav = self(codes[..., start - ctx:start + chunk_size])
            wavs.append(wav[..., ctx * self.total_upsample:])
        return torch.cat(wavs, dim=-1)

    @torch.inference_mode()
    def vocode_windows(self, windows: Sequence[tuple[Tensor, int]],
                       shape: tuple[int, int] | None = None,
                       vocode: Callable[[Tensor], Tensor] | None = None) -> list[Tensor]:
        """Vocode windows `(rows (n, hidden), skip)` of pre-transformer output, of any
        lengths, in one forward, right-padded to the longest, or to `shape` (windows, frames)
        if given and larger; each returns its samples `[skip, num_samples(n))` in float32.

        Padding is exact: every layer is causal but the decoder blocks' transposed convs,
        whose one-step lookahead reaches only samples past `num_samples(n)` (the last kept
        output of k = 2s trimmed by s draws on inputs up to the last real one), so the kept
        samples never see a padded row; padded windows are zeros, computed and dropped.
        vocode: what runs `self.vocode` (CUDA graphs of it, `VocoderGraphs`)."""
        if not windows:
            return []
        lengths = [rows.shape[0] for rows, _ in windows]
        num, longest = shape or (0, 0)
        batch = self.decoder[-1].conv.weight.new_zeros(max(num, len(windows)),
                                                       max(longest, *lengths), self.row_size)
        for i, (rows, _) in enumerate(windows):
            batch[i, :lengths[i]] = rows
        wav = (vocode or self.vocode)(batch)[:, 0].float()        # (B, num_samples(max_len))
        return [wav[i, skip:self.cfg.num_samples(n)]
                for i, ((_, skip), n) in enumerate(zip(windows, lengths))]

    def check_codes(self, codes: Tensor, name: str, batched: bool) -> None:
        """Raise ValueError unless `codes` is an integer (B,) Q, T tensor of valid codes."""
        shape = "(B, num_quantizers, T)" if batched else "(num_quantizers, T)"
        q = self.cfg.num_quantizers
        if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
            raise ValueError(f"{name}: expected an integer tensor, got {codes.dtype}")
        if codes.ndim != (3 if batched else 2) or codes.shape[-2] != q:
            raise ValueError(f"{name}: expected shape {shape} with num_quantizers={q}, "
                             f"got {tuple(codes.shape)}")
        if batched and codes.shape[-1] == 0:
            raise ValueError(f"{name}: no frames (T = 0)")
        if batched and codes.shape[-1] > self.cfg.max_position_embeddings:
            raise ValueError(f"{name}: {codes.shape[-1]} frames exceed max_position_embeddings "
                             f"{self.cfg.max_position_embeddings} of one decode; use "
                             "chunked_decode")
        size = self.cfg.codebook_size
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= size):
            raise ValueError(f"{name}: codes must lie in [0, codebook_size={size}), got values "
                             f"in [{int(codes.min())}, {int(codes.max())}]")

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None, prefix: str = CHECKPOINT_PREFIX
                        ) -> Code2Wav:
        """Build from a Qwen3-Omni checkpoint folder (config.json + safetensors, single or
        sharded), loading only the tensors named `prefix*`, in `dtype` (None: the
        checkpoint's). Missing, unexpected or mis-shaped tensors raise ValueError."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model folder)")
        return cls.load(path, Code2WavConfig.from_hf(AutoConfig.from_pretrained(path)), prefix,
                        device, dtype)

    @classmethod
    def load(cls, path: Path, cfg: Code2WavConfig, prefix: str, device: torch.device | str,
             dtype: torch.dtype | None, exclude: tuple[str, ...] = ()) -> Code2Wav:
        """`cls(cfg)` with the checkpoint's `prefix*` tensors (less `exclude`), strictly."""
        model = load_component(lambda: cls(cfg), path, prefix, device, dtype,
                               cls.packed_modules, exclude)
        return model.requires_grad_(False)


def vocoder_layers(cfg: Code2WavConfig, dim: int, trim_left: bool
                   ) -> tuple[nn.ModuleList, nn.ModuleList]:
    """The convolutional part after the pre-transformer, over rows `dim` wide: per upsampling
    ratio a transposed conv + ConvNeXt block; then the decoder to one channel."""
    upsample = nn.ModuleList(
        nn.ModuleList([CausalConvTranspose1d(dim, dim, r, r), ConvNeXtBlock(dim)])
        for r in cfg.upsampling_ratios)
    dims = [cfg.decoder_dim // 2 ** i for i in range(len(cfg.upsample_rates) + 1)]
    decoder = nn.ModuleList([
        CausalConv1d(dim, dims[0], 7),
        *(DecoderBlock(dims[i], rate, trim_left) for i, rate in enumerate(cfg.upsample_rates)),
        SnakeBeta(dims[-1]),
        CausalConv1d(dims[-1], 1, 7)])
    return upsample, decoder


def check_chunking(cfg: Code2WavConfig, chunk_size: int, left_context: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size {chunk_size}: must be at least 1")
    if left_context < 0:
        raise ValueError(f"left_context {left_context}: must be >= 0")
    if chunk_size + left_context > cfg.max_position_embeddings:
        raise ValueError(f"chunk_size {chunk_size} + left_context {left_context} exceed "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
