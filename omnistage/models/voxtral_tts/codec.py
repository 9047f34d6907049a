"""Voxtral-TTS's codec decoder: codes (B, 37, T) at 12.5 Hz -> waveform (B, T * 1920) at 24 kHz.

    codes -> [semantic table row (256) | 36 FSQ values rescaled to [-1, 1]]     (B, T, 292)
    CausalConv1d k3 s1 (replicate pad) -> 1024
    4 x [transformer (ALiBi, causal sliding window, QK-norm, layer scale)
         then CausalConvTranspose1d k4 s2 (right trim) between them]          -> (B, 8T, 1024)
    CausalConv1d k7 (reflect pad) -> 240 samples a step

The decoder's windows are replayed from the encoder: the configured window halves on each
encoder downsample (16 -> 2) and doubles on each decoder upsample (2, 4, 8, 16).
Checkpoint names are the release's (`audio_tokenizer.decoder_blocks.*`, `output_proj.*`,
`quantizer.semantic_codebook.{embedding_sum,cluster_usage}`); weight-normed convolutions
(`conv.parametrizations.weight.original0/1`) are folded into one weight when loaded."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.linear import Linear
from omnistage.layers.norm import RMSNorm
from omnistage.models.voxtral_tts.config import CodecConfig, load_consolidated, load_into, \
    read_params


def alibi_slopes(n_heads: int) -> Tensor:
    def powers(n: int) -> Tensor:
        r = 2.0 ** (-8.0 / n)
        return torch.tensor([r ** i for i in range(n)], dtype=torch.float32)

    if math.log2(n_heads).is_integer():
        return powers(n_heads)
    m = 2 ** math.floor(math.log2(n_heads))
    return torch.cat([powers(m), powers(2 * m)[::2][: n_heads - m]])


class _FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(dim, hidden), Linear(hidden, dim), Linear(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Attention(nn.Module):
    """Causal ALiBi attention over a window of `window` keys back (key i - window .. i)."""

    def __init__(self, c: CodecConfig, window: int) -> None:
        super().__init__()
        self.h, self.hkv, self.d, self.window = c.n_heads, c.n_kv_heads, c.head_dim, window
        self.wq = Linear(c.dim, c.n_heads * c.head_dim)
        self.wk = Linear(c.dim, c.n_kv_heads * c.head_dim)
        self.wv = Linear(c.dim, c.n_kv_heads * c.head_dim)
        self.wo = Linear(c.n_heads * c.head_dim, c.dim)
        self.q_norm = RMSNorm(c.n_heads * c.head_dim, c.qk_norm_eps)
        self.k_norm = RMSNorm(c.n_kv_heads * c.head_dim, c.qk_norm_eps)
        self.register_buffer("slopes", alibi_slopes(c.n_heads), persistent=False)

    def bias(self, n: int, x: Tensor) -> Tensor:
        pos = torch.arange(n, device=x.device)
        rel = pos[None, :] - pos[:, None]                                   # j - i
        bias = self.slopes.to(x.dtype)[:, None, None] * rel.to(x.dtype)
        return bias.masked_fill((rel > 0) | (rel < -self.window), float("-inf"))

    def forward(self, x: Tensor) -> Tensor:                                 # (B, T, dim)
        b, n, _ = x.shape
        q = self.q_norm(self.wq(x)).view(b, n, self.h, self.d).transpose(1, 2)
        k = self.k_norm(self.wk(x)).view(b, n, self.hkv, self.d).transpose(1, 2)
        v = self.wv(x).view(b, n, self.hkv, self.d).transpose(1, 2)
        if self.h != self.hkv:
            k = k.repeat_interleave(self.h // self.hkv, dim=1)
            v = v.repeat_interleave(self.h // self.hkv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias(n, x)[None])
        return self.wo(o.transpose(1, 2).reshape(b, n, self.h * self.d))


class _Block(nn.Module):
    def __init__(self, c: CodecConfig, window: int) -> None:
        super().__init__()
        self.attention = _Attention(c, window)
        self.feed_forward = _FeedForward(c.dim, c.hidden_dim)
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.scaled = c.layer_scale
        if c.layer_scale:
            self.attention_scale = nn.Parameter(torch.ones(c.dim), requires_grad=False)
            self.ffn_scale = nn.Parameter(torch.ones(c.dim), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        r = self.attention(self.attention_norm(x))
        h = x + (self.attention_scale * r if self.scaled else r)
        r = self.feed_forward(self.ffn_norm(h))
        return h + (self.ffn_scale * r if self.scaled else r)


class _Stack(nn.Module):
    def __init__(self, c: CodecConfig, n_layers: int, window: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): _Block(c, window) for i in range(n_layers)})

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


class _CausalConv(nn.Module):
    """Conv1d padded on the left by k - s (`mode`), and on the right to a whole last step."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, mode: str = "reflect"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cout, cin, k), requires_grad=False)
        self.k, self.stride, self.mode = k, stride, mode

    def forward(self, x: Tensor) -> Tensor:                                 # (B, C, T)
        left, n = self.k - self.stride, x.shape[-1]
        steps = math.ceil((n - self.k + left) / self.stride + 1)
        right = (steps - 1) * self.stride + self.k - left - n
        if self.mode == "reflect" and n <= max(left, right):                # too short to reflect
            extra = max(left, right) - n + 1
            x = F.pad(F.pad(x, (0, extra)), (left, right), "reflect")[..., : n + left + right]
        else:
            x = F.pad(x, (left, right), self.mode)
        return F.conv1d(x, self.weight, stride=self.stride)


class _CausalUpConv(nn.Module):
    """ConvTranspose1d with its k - s extra samples cut on the right."""

    def __init__(self, c: int, k: int, stride: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c, c, k), requires_grad=False)
        self.trim, self.stride = k - stride, stride

    def forward(self, x: Tensor) -> Tensor:
        out = F.conv_transpose1d(x, self.weight, stride=self.stride)
        return out[..., : out.shape[-1] - self.trim]


def decoder_windows(c: CodecConfig) -> list[int]:
    """Each decoder transformer's sliding window, replayed from the encoder's halving."""
    w = c.attn_sliding_window_size
    if c.half_attn_window_upon_downsampling:
        w //= 2 ** sum(1 for s in c.encoder_convs_strides if s > 1)
    grow = c.half_attn_window_upon_downsampling
    w *= 2 if grow and c.decoder_convs_strides[0] > 1 else 1
    out = []
    for idx in range(len(c.decoder_transformer_lengths)):
        out.append(w)
        nxt = idx + 1 < len(c.decoder_convs_strides)
        if nxt and grow and c.decoder_convs_strides[idx + 1] > 1:
            w *= 2
    return out


class VoxtralCodecDecoder(nn.Module):
    def __init__(self, c: CodecConfig) -> None:
        super().__init__()
        if not c.causal or c.channels != 1 or c.use_biases or not c.qk_norm:
            raise NotImplementedError("Voxtral codec: only causal, mono, bias-free, QK-norm "
                                      "(the release's settings) is ported")
        self.cfg = c
        latent = c.semantic_dim + c.acoustic_dim
        ks, ss, lengths = c.decoder_convs_kernels, c.decoder_convs_strides, \
            c.decoder_transformer_lengths
        blocks: list[nn.Module] = [_CausalConv(latent, c.dim, ks[0], ss[0], "replicate")]
        for idx, (n, w) in enumerate(zip(lengths, decoder_windows(c))):
            blocks.append(_Stack(c, n, w))
            if idx + 1 < len(lengths) and (ks[idx + 1] != 1 or ss[idx + 1] != 1):
                blocks.append(_CausalUpConv(c.dim, ks[idx + 1], ss[idx + 1]))
        self.decoder_blocks = nn.ModuleList(blocks)
        self.output_proj = _CausalConv(c.dim, c.pretransform_patch_size, c.patch_proj_kernel_size)
        self.semantic_table = nn.Parameter(torch.empty(c.semantic_codebook_size, c.semantic_dim),
                                           requires_grad=False)

    @classmethod
    def from_pretrained(cls, folder: str | Path, device: str = "cpu") -> VoxtralCodecDecoder:
        _, _, codec_cfg = read_params(folder)
        model = cls(codec_cfg).to(device)
        load_into(model, cls.fold(load_consolidated(folder, "audio_tokenizer.", device)),
                  f"{folder}: audio_tokenizer")
        return model.eval()

    @staticmethod
    def fold(raw: dict[str, Tensor]) -> dict[str, Tensor]:
        """Release names -> ours: weight norm folded (w = g v / |v|, norm over all but dim 0),
        the semantic table = embedding_sum / cluster_usage (clamped at 1e-5)."""
        out: dict[str, Tensor] = {}
        for k, v in raw.items():
            if k.endswith(".conv.parametrizations.weight.original1"):
                stem = k[: -len(".conv.parametrizations.weight.original1")]
                g = raw[f"{stem}.conv.parametrizations.weight.original0"]
                out[f"{stem}.weight"] = torch._weight_norm(v.float(), g.float(), 0).to(v.dtype)
            elif k.endswith(".conv.weight"):                    # a conv without weight norm
                out[k[: -len(".conv.weight")] + ".weight"] = v
            elif not k.endswith(".original0") and not k.startswith("quantizer."):
                out[k] = v
        usage = raw.get("quantizer.semantic_codebook.cluster_usage")
        total = raw.get("quantizer.semantic_codebook.embedding_sum")
        if usage is not None and total is not None:
            out["semantic_table"] = total / usage.clamp(min=1e-5)[:, None]
        return out

    def latents(self, codes: Tensor) -> Tensor:
        """codes (B, 1 + n_acoustic, T), the codec's own (no +2 specials) -> (B, T, latent)."""
        sem = F.embedding(codes[:, 0], self.semantic_table)
        levels = self.cfg.acoustic_codebook_size
        ac = codes[:, 1:].transpose(1, 2).to(sem.dtype) * 2 / (levels - 1) - 1
        return torch.cat([sem, ac], dim=-1)

    @torch.no_grad()
    def forward(self, codes: Tensor) -> Tensor:
        """codes (B, 1 + n_acoustic, T) -> waveform (B, T * samples_per_frame)."""
        h = self.latents(codes)
        for block in self.decoder_blocks:
            if isinstance(block, _Stack):
                h = block(h)
            else:
                h = block(h.transpose(1, 2)).transpose(1, 2)
        out = self.output_proj(h.transpose(1, 2))                          # (B, patch, T')
        return out.transpose(1, 2).reshape(out.shape[0], -1)
