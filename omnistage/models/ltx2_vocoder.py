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
            raise ValueError(f"{path}: an LTX2VocoderWithBWE folder (LTX-2.3's vocoder): "
                             "load it with LTX2VocoderWithBWE (or `load_vocoder`)")
        cfg = config_from_dict(LTX2VocoderConfig, raw, "LTX2Vocoder")
        return build_from_folder(cls, cfg, path, device, dtype)


# ---- LTX-2.3's vocoder: the same generator, then a bandwidth extension to a higher rate ----

@dataclass(frozen=True, slots=True)
class LTX2VocoderWithBWEConfig:
    """config.json of a diffusers `LTX2VocoderWithBWE` folder (its keys, its defaults)."""
    in_channels: int = 128
    hidden_channels: int = 1536
    out_channels: int = 2
    upsample_kernel_sizes: tuple[int, ...] = (11, 4, 4, 4, 4, 4)
    upsample_factors: tuple[int, ...] = (5, 2, 2, 2, 2, 2)
    resnet_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resnet_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    act_fn: str = "snakebeta"
    leaky_relu_negative_slope: float = 0.1
    antialias: bool = True
    antialias_ratio: int = 2
    antialias_kernel_size: int = 12
    final_act_fn: str | None = None
    final_bias: bool = False
    bwe_in_channels: int = 128
    bwe_hidden_channels: int = 512
    bwe_out_channels: int = 2
    bwe_upsample_kernel_sizes: tuple[int, ...] = (12, 11, 4, 4, 4)
    bwe_upsample_factors: tuple[int, ...] = (6, 5, 2, 2, 2)
    bwe_resnet_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    bwe_resnet_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    bwe_act_fn: str = "snakebeta"
    bwe_leaky_relu_negative_slope: float = 0.1
    bwe_antialias: bool = True
    bwe_antialias_ratio: int = 2
    bwe_antialias_kernel_size: int = 12
    bwe_final_act_fn: str | None = None
    bwe_final_bias: bool = False
    filter_length: int = 512
    hop_length: int = 80
    window_length: int = 512
    num_mel_channels: int = 64
    input_sampling_rate: int = 16000
    output_sampling_rate: int = 48000

    def __post_init__(self) -> None:
        if self.output_sampling_rate % self.input_sampling_rate:
            raise ValueError(f"output_sampling_rate={self.output_sampling_rate}: not a multiple "
                             f"of input_sampling_rate={self.input_sampling_rate}")

    def generator(self, prefix: str, rate: int) -> LTX2VocoderConfig:
        """The config of the generator whose keys start with `prefix` ('' or 'bwe_')."""
        names = ("in_channels", "hidden_channels", "out_channels", "upsample_kernel_sizes",
                 "upsample_factors", "resnet_kernel_sizes", "resnet_dilations", "act_fn",
                 "leaky_relu_negative_slope", "antialias", "antialias_ratio",
                 "antialias_kernel_size", "final_act_fn", "final_bias")
        return LTX2VocoderConfig(**{n: getattr(self, prefix + n) for n in names},
                                 output_sampling_rate=rate)


class MelSTFT(nn.Module):
    """Causal log-mel spectrogram with the checkpoint's DFT basis (Hann-windowed) and mel
    filterbank: waveform (N, S) -> log mel (N, mels, S / hop)."""

    def __init__(self, cfg: LTX2VocoderWithBWEConfig) -> None:
        super().__init__()
        self.hop, self.left_pad = cfg.hop_length, max(0, cfg.window_length - cfg.hop_length)
        num_freqs = cfg.filter_length // 2 + 1
        self.stft_fn = nn.Module()
        for name in ("forward_basis", "inverse_basis"):     # stored buffers: read as stored
            self.stft_fn.register_parameter(name, nn.Parameter(
                torch.zeros(num_freqs * 2, 1, cfg.filter_length), requires_grad=False))
        self.mel_basis = nn.Parameter(torch.zeros(cfg.num_mel_channels, num_freqs),
                                      requires_grad=False)

    def forward(self, wave: Tensor) -> Tensor:
        spec = F.conv1d(F.pad(wave[:, None], (self.left_pad, 0)), self.stft_fn.forward_basis,
                        stride=self.hop)
        real, imag = spec.chunk(2, dim=1)
        magnitude = torch.sqrt(real ** 2 + imag ** 2)
        return torch.log(torch.clamp(self.mel_basis.to(magnitude.dtype) @ magnitude, min=1e-5))


def hann_upsample(x: Tensor, ratio: int) -> Tensor:
    """x ratio with a Hann-windowed sinc (rolloff 0.99, 6 zero crossings), replicate padded:
    diffusers' UpSample1d(window_type="hann"), whose filter is computed, not stored."""
    rolloff, zeros = 0.99, 6
    width = math.ceil(zeros / rolloff)
    kernel = 2 * width * ratio + 1
    t = (torch.arange(kernel, device=x.device) / ratio - width) * rolloff
    window = torch.cos(t.clamp(-zeros, zeros) * math.pi / zeros / 2) ** 2
    filt = (torch.sinc(t) * window * rolloff / ratio).to(x.dtype)
    x = F.pad(x, (width, width), mode="replicate")
    x = ratio * F.conv_transpose1d(x, filt.view(1, 1, -1).expand(x.shape[1], -1, -1),
                                   stride=ratio, groups=x.shape[1])
    return x[..., 2 * width * ratio:-(kernel - ratio)]


class LTX2VocoderWithBWE(nn.Module):
    """mel -> the generator's waveform at input_sampling_rate -> its log mel -> a second
    generator's residual at output_sampling_rate, added to the waveform upsampled (Hann sinc),
    clamped to [-1, 1]."""

    def __init__(self, cfg: LTX2VocoderWithBWEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocoder = LTX2Vocoder(cfg.generator("", cfg.input_sampling_rate))
        self.bwe_generator = LTX2Vocoder(cfg.generator("bwe_", cfg.output_sampling_rate))
        self.mel_stft = MelSTFT(cfg)

    @property
    def sample_rate(self) -> int:
        return self.cfg.output_sampling_rate

    def forward(self, mel: Tensor) -> Tensor:
        """mel (B, C, T, M) -> waveform (B, out_channels, T hop_in ratio)."""
        x = self.vocoder(mel)                                        # (B, C, S)
        b, c, num_samples = x.shape
        x = F.pad(x, (0, -num_samples % self.cfg.hop_length))
        low = self.mel_stft(x.flatten(0, 1)).unflatten(0, (b, c))    # (B, C, mels, frames)
        ratio = self.cfg.output_sampling_rate // self.cfg.input_sampling_rate
        wave = torch.clamp(self.bwe_generator(low.transpose(2, 3)) + hann_upsample(x, ratio),
                           -1, 1)
        return wave[..., :num_samples * ratio]

    decode = forward

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> LTX2VocoderWithBWE:
        path = Path(path)
        cfg = config_from_dict(LTX2VocoderWithBWEConfig, read_config(path),
                               "LTX2VocoderWithBWE")
        return build_from_folder(cls, cfg, path, device, dtype)


def load_vocoder(path: str | Path, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None) -> LTX2Vocoder | LTX2VocoderWithBWE:
    """A pipeline's `vocoder/`, whichever of the two its config.json describes."""
    cls = LTX2VocoderWithBWE if "bwe_hidden_channels" in read_config(Path(path)) \
        else LTX2Vocoder
    return cls.from_pretrained(path, device, dtype)
