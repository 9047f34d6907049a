"""BigVGAN, token2wav's vocoder: a log mel (B, mel, T) -> waveform (B, T * prod(upsample_rates)).

    mel -> dB -> [-1, 1] -> conv_pre -> for each upsampling rate r:
        ConvTranspose1d (x r, channels halve) -> mean of the AMP blocks (one per kernel size)
    -> anti-aliased SnakeBeta -> conv_post -> clamp to [-1, 1]

An AMP block is three residual pairs of (anti-aliased SnakeBeta, dilated conv, anti-aliased
SnakeBeta, conv); "anti-aliased" = upsample x2 by a Kaiser-windowed sinc, the activation,
downsample x2 by the same filter (Lee et al., 2023). SnakeBeta is Qwen3-Omni code2wav's.
Parameter names follow the checkpoint's `token2wav.code2wav_bigvgan_model.*`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.qwen3_omni.code2wav_vocoder import SnakeBeta

FILTER_SIZE = 12     # the reference's up- and down-sampling kernel


def kaiser_sinc_filter(cutoff: float, half_width: float, kernel_size: int) -> Tensor:
    """(1, 1, K) low-pass filter: a sinc at `cutoff` (of the sample rate) under a Kaiser
    window whose beta follows the transition band `half_width`, normalised to sum 1."""
    even = kernel_size % 2 == 0
    half = kernel_size // 2
    attenuation = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(kernel_size, beta=beta, periodic=False, dtype=torch.float32)
    time = (torch.arange(-half, half) + 0.5) if even else (torch.arange(kernel_size) - half)
    filt = 2 * cutoff * window * torch.sinc(2 * cutoff * time)
    return (filt / filt.sum()).view(1, 1, kernel_size)


class AntiAliasedSnake(nn.Module):
    """SnakeBeta at twice the sample rate: (B, C, T) -> (B, C, T)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.act = SnakeBeta(channels)
        self.register_buffer("filter", kaiser_sinc_filter(0.25, 0.3, FILTER_SIZE),
                             persistent=False)
        self.pad = FILTER_SIZE // 2 - 1                              # upsampling's edge pad
        self.crop_left = self.pad * 2 + (FILTER_SIZE - 2) // 2
        self.crop_right = self.pad * 2 + (FILTER_SIZE - 2 + 1) // 2

    def forward(self, x: Tensor) -> Tensor:
        channels = x.shape[1]
        filt = self.filter.to(x.dtype).expand(channels, -1, -1)
        up = 2 * F.conv_transpose1d(F.pad(x, (self.pad, self.pad), mode="replicate"), filt,
                                    stride=2, groups=channels)
        up = self.act(up[..., self.crop_left:-self.crop_right])
        down = F.pad(up, (FILTER_SIZE // 2 - 1, FILTER_SIZE // 2), mode="replicate")
        return F.conv1d(down, filt, stride=2, groups=channels)


class AMPBlock(nn.Module):
    def __init__(self, channels: int, kernel: int, dilations: list[int]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, dilation=d, padding=(kernel * d - d) // 2)
            for d in dilations)
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2) for _ in dilations)
        self.activations = nn.ModuleList(AntiAliasedSnake(channels)
                                         for _ in range(2 * len(dilations)))

    def forward(self, x: Tensor) -> Tensor:
        for i, (conv1, conv2) in enumerate(zip(self.convs1, self.convs2)):
            h = conv1(self.activations[2 * i](x))
            x = x + conv2(self.activations[2 * i + 1](h))
        return x


def context_frames(rates: list[int], kernels: list[int], res_kernels: list[int],
                   res_dilations: list[list[int]]) -> int:
    """How many mel frames either side of a frame its samples depend on (34 for the released
    vocoder, 22 for the tiny test one): a window holding this many frames of real mel on both
    sides of a stretch decodes that stretch's samples exactly as the whole decode does.

    Walked exactly from each output sample of one hop back to the mel: a k-tap conv of
    dilation d widens the interval by (k - 1) d / 2 a side, an anti-aliased activation by 5
    (its 12-tap filters at twice the rate), an AMP block by its three pairs; a transposed conv
    (rate r, kernel k, padding p) maps [lo, hi] to [ceil((lo + p - k + 1) / r),
    floor((hi + p) / r)]. Samples near the ends of that interval depend on the frame by less
    than float32 can show (perturbed in float64, the released vocoder's samples move no
    further than 28 frames away), but they do depend on it."""
    act = FILTER_SIZE // 2 - 1
    amp = max(sum(2 * act + (k - 1) * d // 2 + (k - 1) // 2 for d in dilations)
              for k, dilations in zip(res_kernels, res_dilations))
    reach = 0
    for n in range(math.prod(rates)):                # each phase of an output sample
        lo, hi = n - 3 - act, n + 3 + act              # conv_post (k = 7), activation_post
        for r, k in zip(reversed(rates), reversed(kernels)):
            p = (k - r) // 2
            lo, hi = -((amp + k - 1 - p - lo) // r), (hi + amp + p) // r
        reach = max(reach, 3 - lo, hi + 3)             # conv_pre (k = 7); n is in frame 0
    return reach


class BigVGAN(nn.Module):
    def __init__(self, mel_dim: int, channels: int, rates: list[int], kernels: list[int],
                 res_kernels: list[int], res_dilations: list[list[int]]) -> None:
        super().__init__()
        self.num_kernels = len(res_kernels)
        self.hop = math.prod(rates)                                 # samples per mel frame
        self.context_frames = context_frames(rates, kernels, res_kernels, res_dilations)
        self.conv_pre = nn.Conv1d(mel_dim, channels, 7, 1, padding=3)
        self.ups = nn.ModuleList(
            nn.ModuleList([nn.ConvTranspose1d(channels >> i, channels >> (i + 1), k, r,
                                              padding=(k - r) // 2)])
            for i, (r, k) in enumerate(zip(rates, kernels)))
        self.resblocks = nn.ModuleList(
            AMPBlock(channels >> (i + 1), k, d)
            for i in range(len(rates)) for k, d in zip(res_kernels, res_dilations))
        last = channels >> len(rates)
        self.activation_post = AntiAliasedSnake(last)
        self.conv_post = nn.Conv1d(last, 1, 7, 1, padding=3, bias=False)

    def forward(self, mel: Tensor) -> Tensor:                     # (B, mel, T) -> (B, samples)
        db = 20 * torch.log10(torch.clamp(mel.exp(), min=math.exp(-115 / 20 * math.log(10))))
        x = self.conv_pre(torch.clamp(2 * (db - 20 + 115) / 115 - 1, -1, 1))
        for i, (up,) in enumerate(self.ups):
            x = up(x)
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            x = sum(block(x) for block in blocks) / self.num_kernels
        x = self.conv_post(self.activation_post(x))
        return torch.clamp(x, -1.0, 1.0).squeeze(1)
