"""CosyVoice3's front-end features of a reference clip, in plain torch (no whisper, no
torchaudio): the speech tokenizer's input (Whisper's log-mel, 128 bins, 16 kHz) and the speaker
encoder's input (Kaldi fbank, 80 bins, dither 0, mean-normalised over time). Both take a mono
float waveform at 16 kHz in [-1, 1]; golden against upstream's own feature calls
(tests/golden/models/test_cosyvoice3_features.py)."""

from __future__ import annotations

import math
from functools import lru_cache

import torch

SAMPLE_RATE = 16000
N_FFT = 400                       # 25 ms
HOP = 160                         # 10 ms


def _slaney_mel(f: torch.Tensor) -> torch.Tensor:
    lin = f / (200.0 / 3)
    log = 15.0 + torch.log(f.clamp(min=1000.0) / 1000.0) / (math.log(6.4) / 27.0)
    return torch.where(f >= 1000.0, log, lin)


def _slaney_hz(m: torch.Tensor) -> torch.Tensor:
    lin = m * (200.0 / 3)
    log = 1000.0 * torch.exp((math.log(6.4) / 27.0) * (m - 15.0))
    return torch.where(m >= 15.0, log, lin)


@lru_cache(maxsize=4)
def whisper_mel_filters(n_mels: int = 128) -> torch.Tensor:
    """Slaney-normalised triangular filters over the 201 rFFT bins (librosa's mel(), which
    Whisper ships as mel_filters.npz): (n_mels, 201) float32."""
    fft_f = torch.linspace(0, SAMPLE_RATE / 2, N_FFT // 2 + 1, dtype=torch.float64)
    mels = torch.linspace(0.0, float(_slaney_mel(torch.tensor(SAMPLE_RATE / 2.0))), n_mels + 2,
                          dtype=torch.float64)
    mel_f = _slaney_hz(mels)
    fdiff = mel_f.diff()
    ramps = mel_f[:, None] - fft_f[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    w = torch.clamp(torch.minimum(lower, upper), min=0.0)
    w = w * (2.0 / (mel_f[2:] - mel_f[:-2]))[:, None]
    return w.float()


def whisper_log_mel(wav: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """(N,) float waveform -> (n_mels, T) Whisper log-mel: centred STFT with a periodic Hann,
    power, mel, log10 floored at 1e-10 and at max - 8, then (x + 4) / 4."""
    wav = wav.float().reshape(-1)
    spec = torch.stft(wav, N_FFT, HOP, window=torch.hann_window(N_FFT), return_complex=True)
    power = spec[..., :-1].abs() ** 2
    log = (whisper_mel_filters(n_mels) @ power).clamp(min=1e-10).log10()
    log = torch.maximum(log, log.max() - 8.0)
    return (log + 4.0) / 4.0


def _kaldi_mel(f: torch.Tensor) -> torch.Tensor:
    return 1127.0 * torch.log1p(f / 700.0)


@lru_cache(maxsize=4)
def kaldi_mel_banks(num_bins: int = 80, padded: int = 512, low: float = 20.0) -> torch.Tensor:
    """Kaldi's mel banks (triangles in 1127 ln(1 + f/700) over the lower padded/2 bins, the
    Nyquist column zero): (num_bins, padded // 2 + 1) float32."""
    high = SAMPLE_RATE / 2
    m_low, m_high = _kaldi_mel(torch.tensor(low)), _kaldi_mel(torch.tensor(high))
    delta = (m_high - m_low) / (num_bins + 1)
    b = torch.arange(num_bins, dtype=torch.float32)[:, None]
    left, center, right = m_low + b * delta, m_low + (b + 1) * delta, m_low + (b + 2) * delta
    mel = _kaldi_mel(SAMPLE_RATE / padded * torch.arange(padded // 2, dtype=torch.float32))[None]
    up, down = (mel - left) / (center - left), (right - mel) / (right - center)
    banks = torch.clamp(torch.minimum(up, down), min=0.0)
    return torch.nn.functional.pad(banks, (0, 1))


def kaldi_fbank(wav: torch.Tensor, num_bins: int = 80) -> torch.Tensor:
    """(N,) float waveform -> (T, num_bins) Kaldi log fbank (25 ms / 10 ms frames, snip edges,
    DC removed, pre-emphasis 0.97, Povey window, 512-point power spectrum, no dither)."""
    wav = wav.float().reshape(-1)
    frames = wav.unfold(0, N_FFT, HOP)                                   # (T, 400)
    frames = frames - frames.mean(dim=1, keepdim=True)
    prev = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = frames - 0.97 * prev
    frames = frames * torch.hann_window(N_FFT, periodic=False).pow(0.85)
    frames = torch.nn.functional.pad(frames, (0, 512 - N_FFT))
    power = torch.fft.rfft(frames).abs().pow(2.0)
    energies = power @ kaldi_mel_banks(num_bins).T
    return energies.clamp(min=torch.finfo(torch.float32).eps).log()


def speaker_features(wav: torch.Tensor) -> torch.Tensor:
    """campplus.onnx's input: kaldi_fbank minus its mean over time, (T, 80)."""
    f = kaldi_fbank(wav)
    return f - f.mean(dim=0, keepdim=True)


@lru_cache(maxsize=4)
def slaney_filters(rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float
                   ) -> torch.Tensor:
    """librosa's mel(sr=rate, n_fft, n_mels, fmin, fmax) (Slaney scale and norm), which
    matcha's mel_spectrogram uses: (n_mels, n_fft // 2 + 1) float32."""
    fft_f = torch.linspace(0, rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    lo, hi = (float(_slaney_mel(torch.tensor(float(f), dtype=torch.float64)))
              for f in (fmin, fmax))
    mel_f = _slaney_hz(torch.linspace(lo, hi, n_mels + 2, dtype=torch.float64))
    ramps = mel_f[:, None] - fft_f[None, :]
    fdiff = mel_f.diff()
    w = torch.clamp(torch.minimum(-ramps[:-2] / fdiff[:-1, None], ramps[2:] / fdiff[1:, None]),
                    min=0.0)
    return (w * (2.0 / (mel_f[2:] - mel_f[:-2]))[:, None]).float()


def prompt_mel(wav: torch.Tensor, rate: int = 24000, n_fft: int = 1920, hop: int = 480,
               n_mels: int = 80, fmin: float = 0.0, fmax: float | None = None) -> torch.Tensor:
    """The flow's prompt mel of a clip at `rate` (matcha's mel_spectrogram with center=False,
    as upstream's `feat_extractor`): reflect-padded by (n_fft - hop) / 2 each side, periodic
    Hann STFT, magnitude sqrt(re^2 + im^2 + 1e-9), Slaney mel, log floored at 1e-5:
    (frames, n_mels)."""
    wav = wav.float().reshape(1, 1, -1)
    pad = (n_fft - hop) // 2
    wav = torch.nn.functional.pad(wav, (pad, pad), mode="reflect").reshape(-1)
    spec = torch.stft(wav, n_fft, hop, window=torch.hann_window(n_fft), center=False,
                      return_complex=True)
    mag = torch.sqrt(spec.real ** 2 + spec.imag ** 2 + 1e-9)
    mel = slaney_filters(rate, n_fft, n_mels, fmin, rate / 2 if fmax is None else fmax) @ mag
    return mel.clamp(min=1e-5).log().T.contiguous()
