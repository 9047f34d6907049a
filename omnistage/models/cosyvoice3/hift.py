"""CosyVoice3's vocoder: the causal HiFT (neural source filter + iSTFT), mel -> 24 kHz waveform.

    mel (B, mel, T) -> f0 predictor (causal convs, float64 as upstream insists) -> f0 (B, T)
    f0 -> x hop (nearest) -> harmonic sines (phase integrated at frame rate, held per sample)
        + noise -> tanh(linear) -> source s (B, 1, T * hop)
    mel -> conv_pre (sees conv_pre_look_right frames ahead) -> per upsampling stage:
           leaky ReLU -> nearest-upsample + causal conv -> + (source STFT -> causal strided conv
           -> resblock) -> mean of resblocks
    -> conv_post -> magnitude exp(.), phase sin(.) -> iSTFT -> clamp to audio_limit

Every conv is causal (padded on the left) except conv_pre and the f0 predictor's first,
padded on the right (finalize=True: the whole utterance is here). finalize=False (a stream's
chunk, more mel to come): the frames whose right context is not here yet are dropped, as
upstream's does with its look-right caches: the f0 predictor's 3, conv_pre's
conv_pre_look_right, and one frame of iSTFT overlap; what is left equals the finalized
waveform's start. Upstream's causal source
draws its "random" phases and noise from buffers filled by the global RNG when the module is
built (`SineGen2.rand_ini`, `.sine_waves`, `SourceModuleHnNSF.uv`); they are never saved, so
`SourceNoise` carries them here: drawn from a seed, or given (the golden tests give upstream's).
Parameter names follow the released hift.pt, weight norm folded at load (models/cosyvoice3/
model.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.cosyvoice3.config import HiFTConfig


@dataclass(frozen=True, slots=True)
class SourceNoise:
    rand_ini: Tensor             # (1, harmonics + 1): initial phases, the fundamental's 0
    sine_waves: Tensor           # (1, L, harmonics + 1) uniform [0, 1): the sines' noise
    uv: Tensor                   # (1, L, 1) uniform [0, 1): the noise branch (unused by decode)

    @classmethod
    def seeded(cls, seed: int, num_samples: int, dim: int) -> SourceNoise:
        gen = torch.Generator().manual_seed(seed)
        ini = torch.rand(1, dim, generator=gen)
        ini[:, 0] = 0
        return cls(ini, torch.rand(1, num_samples, dim, generator=gen),
                   torch.rand(1, num_samples, 1, generator=gen))


class CausalConv1d(nn.Conv1d):
    """Padded by dilation * (kernel - 1) zeros on the left (or on the right: `right`)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int = 1,
                 right: bool = False) -> None:
        super().__init__(c_in, c_out, kernel, dilation=dilation)
        self.pad = (0, dilation * (kernel - 1)) if right else (dilation * (kernel - 1), 0)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, self.pad))


class CausalConv1dDownSample(nn.Conv1d):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int) -> None:
        super().__init__(c_in, c_out, kernel, stride)
        self.pad = stride - 1

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.pad, 0)))


class CausalConv1dUpsample(nn.Conv1d):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int) -> None:
        super().__init__(c_in, c_out, kernel)
        self.stride_up = stride

    def forward(self, x: Tensor) -> Tensor:
        x = F.interpolate(x, scale_factor=self.stride_up, mode="nearest")
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class Snake(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:                 # (B, C, T)
        alpha = self.alpha[None, :, None]
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(CausalConv1d(channels, channels, kernel, d) for d in dilations)
        self.convs2 = nn.ModuleList(CausalConv1d(channels, channels, kernel) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = x + c2(a2(c1(a1(x))))
        return x


class CausalConvRNNF0Predictor(nn.Module):
    def __init__(self, in_channels: int, cond_channels: int) -> None:
        super().__init__()
        convs = [CausalConv1d(in_channels, cond_channels, 4, right=True)]
        convs += [CausalConv1d(cond_channels, cond_channels, 3) for _ in range(4)]
        self.condnet = nn.Sequential(*[m for c in convs for m in (c, nn.ELU())])
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: Tensor) -> Tensor:               # (B, mel, T) -> (B, T) f0 in Hz
        return self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1).abs()


class SourceModuleHnNSF(nn.Module):
    def __init__(self, num_harmonics: int) -> None:
        super().__init__()
        self.l_linear = nn.Linear(num_harmonics + 1, 1)


class CausalHiFTGenerator(nn.Module):
    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        base, ups = cfg.base_channels, cfg.upsample_rates
        self.m_source = SourceModuleHnNSF(cfg.nb_harmonics)
        self.conv_pre = CausalConv1d(cfg.in_channels, base, cfg.conv_pre_look_right + 1,
                                     right=True)
        self.ups = nn.ModuleList(CausalConv1dUpsample(base >> i, base >> (i + 1), k, u)
                                 for i, (u, k) in enumerate(zip(ups, cfg.upsample_kernel_sizes)))
        down_rates = [math.prod(([1] + list(ups[::-1][:-1]))[:j + 1]) for j in range(len(ups))]
        self.source_downs, self.source_resblocks = nn.ModuleList(), nn.ModuleList()
        for i, (u, k, d) in enumerate(zip(down_rates[::-1], cfg.source_resblock_kernel_sizes,
                                          cfg.source_resblock_dilation_sizes)):
            ch = base >> (i + 1)
            self.source_downs.append(CausalConv1d(cfg.n_fft + 2, ch, 1) if u == 1
                                     else CausalConv1dDownSample(cfg.n_fft + 2, ch, 2 * u, u))
            self.source_resblocks.append(ResBlock(ch, k, d))
        self.resblocks = nn.ModuleList(
            ResBlock(base >> (i + 1), k, d) for i in range(len(ups))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
        self.conv_post = CausalConv1d(base >> len(ups), cfg.n_fft + 2, 7)
        self.f0_predictor = CausalConvRNNF0Predictor(cfg.in_channels, cfg.f0_cond_channels)
        self.register_buffer("stft_window", torch.hann_window(cfg.n_fft, periodic=True),
                             persistent=False)

    def source(self, f0: Tensor, noise: SourceNoise) -> Tensor:
        """f0 (B, T) Hz -> the excitation (B, 1, T * hop): harmonic sines where voiced, plus
        noise (upstream's SineGen2 with causal=True, then the harmonics' merge)."""
        c, scale = self.cfg, self.cfg.samples_per_frame
        f0 = f0.repeat_interleave(scale, dim=1).unsqueeze(-1)               # (B, L, 1)
        harmonics = torch.arange(1, c.nb_harmonics + 2, device=f0.device, dtype=f0.dtype)
        rad = (f0 * harmonics / c.sampling_rate) % 1                        # (B, L, H)
        rad[:, 0, :] = rad[:, 0, :] + noise.rand_ini.to(rad)
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / scale, mode="linear")
        phase = torch.cumsum(rad, dim=2) * 2 * math.pi                      # (B, H, T)
        phase = F.interpolate(phase * scale, scale_factor=scale, mode="nearest").transpose(1, 2)
        sines = torch.sin(phase) * c.nsf_alpha
        uv = (f0 > c.nsf_voiced_threshold).to(sines.dtype)
        amp = uv * c.nsf_sigma + (1 - uv) * c.nsf_alpha / 3
        sines = sines * uv + amp * noise.sine_waves[:, :sines.shape[1]].to(sines)
        return torch.tanh(self.m_source.l_linear(sines)).transpose(1, 2)

    def decode(self, mel: Tensor, s: Tensor, finalize: bool = True) -> Tensor:
        """mel (B, mel, T), source (B, 1, T * hop) -> waveform (B, T * hop); finalize=False:
        (B, (T - conv_pre_look_right - 1) * hop), the samples whose mel is all here."""
        c = self.cfg
        spec = torch.stft(s.squeeze(1), c.n_fft, c.hop_len, c.n_fft, window=self.stft_window,
                          return_complex=True)
        s_stft = torch.cat([spec.real, spec.imag], dim=1)                   # (B, n_fft + 2, F)
        x = self.conv_pre(mel)
        scale = math.prod(c.upsample_rates)
        if not finalize:
            x = x[..., :x.shape[-1] - c.conv_pre_look_right]
            s_stft = s_stft[..., :s_stft.shape[-1] - scale * c.conv_pre_look_right]
        n = len(c.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, c.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            x = sum(self.resblocks[i * n + j](x) for j in range(n)) / n
        x = self.conv_post(F.leaky_relu(x))
        half = c.n_fft // 2 + 1
        magnitude = torch.exp(x[:, :half]).clamp(max=1e2)
        phase = torch.sin(x[:, half:])
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        wave = torch.istft(spec, c.n_fft, c.hop_len, c.n_fft, window=self.stft_window)
        if not finalize:
            wave = wave[..., :wave.shape[-1] - scale * c.hop_len]
        return wave.clamp(-c.audio_limit, c.audio_limit)

    @torch.no_grad()
    def forward(self, mel: Tensor, noise: SourceNoise, finalize: bool = True
                ) -> tuple[Tensor, Tensor]:
        """mel (B, mel, T) -> (waveform (B, T * hop), source (B, 1, T * hop)); finalize=False:
        the waveform of the first T - lag frames (`lag`), the source of T - 3."""
        f0 = self.f0_predictor.double()(mel.double()).to(mel.dtype)
        if not finalize:
            right = self.f0_predictor.condnet[0].pad[1]
            f0, mel = f0[:, :f0.shape[1] - right], mel[..., :mel.shape[-1] - right]
        s = self.source(f0, noise)
        return self.decode(mel, s, finalize), s

    @property
    def lag(self) -> int:
        """Mel frames a finalize=False call holds back: the f0 predictor's look-right,
        conv_pre's, and one of iSTFT overlap."""
        return self.f0_predictor.condnet[0].pad[1] + self.cfg.conv_pre_look_right + 1
