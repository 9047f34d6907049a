"""LTX-2's vocoder: diffusers' `LTX2Vocoder` (a HiFi-GAN / BigVGAN generator) in plain PyTorch.

    mel (B, C, T, M) -> (B, C M, T) -> conv_in -> [act, transposed conv (x f_i),
        mean of res blocks] per stage -> act_out -> conv_out -> (tanh) -> wave (B, out, T prod f)

Activations are leaky ReLU (LTX-2) or snake / snake-beta, optionally anti-aliased (upsample x2
with a Kaiser-windowed sinc, activate, low-pass and downsample). The sinc filters are stored in
the checkpoint (persistent buffers in diffusers) and loaded as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.diffusers_loader import build_from_folder, config_from_dict, read_config


@dataclass(frozen=True, slots=True)
class LTX2VocoderConfig:
    """config.json of a diffusers `LTX2Vocoder` folder (its keys, its defaults)."""
    in_channels: int = 128
    hidden_channels: int = 1024
    out_channels: int = 2
    upsample_kernel_sizes: tuple[int, ...] = (16, 15, 8, 4, 4)
    upsample_factors: tuple[int, ...] = (6, 5, 2, 2, 2)
    resnet_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resnet_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    act_fn: str = "leaky_relu"
    leaky_relu_negative_slope: float = 0.1
    antialias: bool = False
    antialias_ratio: int = 2
    antialias_kernel_size: int = 12
    final_act_fn: str | None = "tanh"
    final_bias: bool = True
    output_sampling_rate: int = 24000

    def __post_init__(self) -> None:
        if len(self.upsample_kernel_sizes) != len(self.upsample_factors):
            raise ValueError("upsample_kernel_sizes and upsample_factors: lengths differ")
        if len(self.resnet_kernel_sizes) != len(self.resnet_dilations):
            raise ValueError("resnet_kernel_sizes and resnet_dilations: lengths differ")
        if self.act_fn not in ("snakebeta", "snake", "leaky_relu"):
            raise ValueError(f"act_fn: {self.act_fn!r} is not snakebeta, snake or leaky_relu")
        if self.act_fn == "leaky_relu" and self.antialias:
            raise ValueError("act_fn leaky_relu with antialias: not supported")
        if self.final_act_fn not in ("tanh", "clamp", None):
            raise ValueError(f"final_act_fn: {self.final_act_fn!r} is not tanh, clamp or null")
        object.__setattr__(self, "resnet_dilations",
                           tuple(tuple(d) for d in self.resnet_dilations))


def _filter_param(kernel_size: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(1, 1, kernel_size), requires_grad=False)


class UpSample1d(nn.Module):
    """x ratio by a transposed depthwise conv with the stored low-pass filter (replicate pad)."""

    def __init__(self, ratio: int, kernel_size: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.pad = kernel_size // ratio - 1
        self.crop_left = self.pad * ratio + (kernel_size - ratio) // 2
        self.crop_right = self.pad * ratio + (kernel_size - ratio + 1) // 2
        self.filter = _filter_param(kernel_size)

    def forward(self, x: Tensor) -> Tensor:
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        w = self.filter.to(x.dtype).expand(x.shape[1], -1, -1)
        x = self.ratio * F.conv_transpose1d(x, w, stride=self.ratio, groups=x.shape[1])
        return x[..., self.crop_left:-self.crop_right]


class DownSample1d(nn.Module):
    """Low-pass with the stored filter and keep every ratio-th sample (replicate pad)."""

    def __init__(self, ratio: int, kernel_size: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.pads = (kernel_size // 2 + kernel_size % 2 - 1, kernel_size // 2)
        self.filter = _filter_param(kernel_size)

    def forward(self, x: Tensor) -> Tensor:
        w = self.filter.to(x.dtype).expand(x.shape[1], -1, -1)
        return F.conv1d(F.pad(x, self.pads, mode="replicate"), w, stride=self.ratio,
                        groups=x.shape[1])


class SnakeBeta(nn.Module):
    """x + sin(a x)^2 / b, a = exp(alpha), b = exp(beta) (snake: b = a), per channel."""

    def __init__(self, channels: int, use_beta: bool) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels)) if use_beta else None

    def forward(self, x: Tensor) -> Tensor:
        alpha = torch.exp(self.alpha)[None, :, None]
        amp = torch.exp(self.beta)[None, :, None] if self.beta is not None else alpha
        return x + (1.0 / (amp + 1e-9)) * torch.sin(x * alpha).pow(2)


class AntiAliasAct1d(nn.Module):
    def __init__(self, act: nn.Module, ratio: int, kernel_size: int) -> None:
        super().__init__()
        self.upsample = UpSample1d(ratio, kernel_size)
        self.act = act
        self.downsample = DownSample1d(ratio, kernel_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.downsample(self.act(self.upsample(x)))


def _activation(channels: int, cfg: LTX2VocoderConfig) -> nn.Module:
    if cfg.act_fn == "leaky_relu":
        return nn.LeakyReLU(cfg.leaky_relu_negative_slope)
    act = SnakeBeta(channels, use_beta=cfg.act_fn == "snakebeta")
    if cfg.antialias:
        return AntiAliasAct1d(act, cfg.antialias_ratio, cfg.antialias_kernel_size)
    return act


class ResBlock(nn.Module):
    """Per dilation d: x += conv(act(conv_d(act(x)))), 'same' padding."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...],
                 cfg: LTX2VocoderConfig) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(nn.Conv1d(channels, channels, kernel_size, dilation=d,
                                              padding="same") for d in dilations)
        self.convs2 = nn.ModuleList(nn.Conv1d(channels, channels, kernel_size, padding="same")
                                    for _ in dilations)
        self.acts1 = nn.ModuleList(_activation(channels, cfg) for _ in dilations)
        self.acts2 = nn.ModuleList(_activation(channels, cfg) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        for act1, conv1, act2, conv2 in zip(self.acts1, self.convs1, self.acts2, self.convs2):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class LTX2Vocoder(nn.Module):
    """Mel spectrogram to waveform; `from_pretrained` loads a diffusers `vocoder/`."""

    def __init__(self, cfg: LTX2VocoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.conv_in = nn.Conv1d(cfg.in_channels, cfg.hidden_channels, 7, padding=3)
        self.upsamplers = nn.ModuleList()
        self.resnets = nn.ModuleList()
        channels = cfg.hidden_channels
        for factor, kernel in zip(cfg.upsample_factors, cfg.upsample_kernel_sizes):
            self.upsamplers.append(nn.ConvTranspose1d(channels, channels // 2, kernel,
                                                      stride=factor,
                                                      padding=(kernel - factor) // 2))
            channels //= 2
            self.resnets.extend(ResBlock(channels, k, d, cfg)
                                for k, d in zip(cfg.resnet_kernel_sizes, cfg.resnet_dilations))
        if cfg.act_fn == "leaky_relu":
            self.act_out: nn.Module = nn.LeakyReLU()        # diffusers: the default slope
        else:
            self.act_out = AntiAliasAct1d(SnakeBeta(channels, use_beta=True),
                                          cfg.antialias_ratio, cfg.antialias_kernel_size)
        self.conv_out = nn.Conv1d(channels, cfg.out_channels, 7, padding=3,
                                  bias=cfg.final_bias)

    @property
    def sample_rate(self) -> int:
        return self.cfg.output_sampling_rate

    @property
    def hop_length(self) -> int:
        """Waveform samples per mel frame."""
        return math.prod(self.cfg.upsample_factors)

    def forward(self, mel: Tensor) -> Tensor:
        """mel (B, C, T, M), C M = in_channels -> waveform (B, out_channels, T hop_length)."""
        if mel.dim() != 4 or mel.shape[1] * mel.shape[3] != self.cfg.in_channels:
            raise ValueError(f"mel: expected (B, C, frames, mel bins) with C * bins = "
                             f"{self.cfg.in_channels}, got {tuple(mel.shape)}")
        x = self.conv_in(mel.transpose(2, 3).flatten(1, 2))      # (B, hidden, T)
        n = len(self.cfg.resnet_kernel_sizes)
        for i, up in enumerate(self.upsamplers):
            if self.cfg.act_fn == "leaky_relu":
                x = F.leaky_relu(x, self.cfg.leaky_relu_negative_slope)
            x = up(x)
            x = torch.stack([r(x) for r in self.resnets[i * n:(i + 1) * n]]).mean(dim=0)
        x = self.conv_out(self.act_out(x))
        if self.cfg.final_act_fn == "tanh":
            return torch.tanh(x)
        return x.clamp(-1, 1) if self.cfg.final_act_fn == "clamp" else x

    decode = forward

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> LTX2Vocoder:
        """Build from a diffusers `vocoder/` folder in `dtype` (None: the checkpoint's).
        Missing, unexpected or mis-shaped tensors raise ValueError naming them."""
        path = Path(path)
        raw = read_config(path)
        if "bwe_hidden_channels" in raw:
            raise ValueError(f"{path}: an LTX2VocoderWithBWE (LTX-2.3's bandwidth-extended "
                             "vocoder) is not supported yet")
        cfg = config_from_dict(LTX2VocoderConfig, raw, "LTX2Vocoder")
        return build_from_folder(cls, cfg, path, device, dtype)
