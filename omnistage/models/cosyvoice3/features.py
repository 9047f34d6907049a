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
