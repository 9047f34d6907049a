"""Qwen3-Omni code2wav's convolutional part (the vocoder after the pre-transformer): causal
convolutions, SnakeBeta, ConvNeXt upsampling and the decoder blocks. Module names follow
HF's `Qwen3OmniMoeCode2Wav*` so checkpoint keys map one-to-one; Qwen2.5-Omni's BigVGAN and
Qwen3-TTS's speech tokenizer reuse these layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.qwen3_omni.code2wav_config import Code2WavConfig


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
