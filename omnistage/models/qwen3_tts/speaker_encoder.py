"""Qwen3-TTS's speaker encoder (Base models): the x-vector a voice clone speaks with, from
24 kHz reference audio. ECAPA-TDNN (https://huggingface.co/papers/2005.07143) over log-mel
frames, as the reference's `Qwen3TTSSpeakerEncoder` and `mel_spectrogram`; module names follow
the checkpoint's `speaker_encoder.*` tensors.

    wav (N,) ─ log-mel (T, 128): hann 1024, hop 256, slaney mel 0..12 kHz, reflect-padded
      ─ TDNN ─ SE-Res2Net blocks ─ concat(blocks 1..) ─ TDNN (MFA)
      ─ attentive statistics pooling (mean, std) ─ 1x1 conv ─> (enc_dim,)

Every conv pads "same" by reflection, as the reference's `padding_mode="reflect"`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.audio_utils import mel_filter_bank

from omnistage.models.loader import load_component
from omnistage.models.qwen3_tts.config import Qwen3TTSConfig, SpeakerEncoderConfig

CHECKPOINT_PREFIX = "speaker_encoder."
N_FFT, HOP, NUM_MELS = 1024, 256, 128


def log_mel(wav: Tensor, sample_rate: int = 24000) -> Tensor:
    """wav (N,) float -> (T, 128) log-mel frames, as the reference's `mel_spectrogram`."""
    bank = torch.from_numpy(mel_filter_bank(
        num_frequency_bins=N_FFT // 2 + 1, num_mel_filters=NUM_MELS, min_frequency=0.0,
        max_frequency=sample_rate / 2, sampling_rate=sample_rate, norm="slaney",
        mel_scale="slaney")).float().T.to(wav.device)                   # (128, 513)
    pad = (N_FFT - HOP) // 2
    y = F.pad(wav.float()[None, None], (pad, pad), mode="reflect")[0]
    spec = torch.stft(y, N_FFT, hop_length=HOP, win_length=N_FFT,
                      window=torch.hann_window(N_FFT, device=wav.device), center=False,
                      normalized=False, onesided=True, return_complex=True)
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)      # (1, 513, T)
    return torch.log(torch.clamp(bank @ mag, min=1e-5))[0].T             # (T, 128)


def _conv(in_ch: int, out_ch: int, kernel: int = 1, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(in_ch, out_ch, kernel, dilation=dilation, padding="same",
                     padding_mode="reflect")


class TimeDelayNetBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = _conv(in_ch, out_ch, kernel, dilation)

    def forward(self, x: Tensor) -> Tensor:                       # (B, C, T)
        return F.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    """Channels in `scale` groups; group i > 0 goes through a TDNN after adding group i-1's
    output (i > 1)."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(TimeDelayNetBlock(width, width, kernel, dilation)
                                    for _ in range(scale - 1))

    def forward(self, x: Tensor) -> Tensor:
        parts = list(torch.chunk(x, self.scale, dim=1))
        out = [parts[0]]
        for i, block in enumerate(self.blocks, start=1):
            out.append(block(parts[i] if i == 1 else parts[i] + out[-1]))
        return torch.cat(out, dim=1)


class SqueezeExcitationBlock(nn.Module):
    def __init__(self, channels: int, se_channels: int) -> None:
        super().__init__()
        self.conv1 = _conv(channels, se_channels)
        self.conv2 = _conv(se_channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SqueezeExcitationRes2NetBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, scale: int, se_channels: int, kernel: int,
                 dilation: int) -> None:
        super().__init__()
        self.tdnn1 = TimeDelayNetBlock(in_ch, out_ch, 1, 1)
        self.res2net_block = Res2NetBlock(out_ch, scale, kernel, dilation)
        self.tdnn2 = TimeDelayNetBlock(out_ch, out_ch, 1, 1)
        self.se_block = SqueezeExcitationBlock(out_ch, se_channels)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


class AttentiveStatisticsPooling(nn.Module):
    """Attention over time from each frame with the utterance's mean and std, then the
    attention-weighted mean and std per channel: (B, C, T) -> (B, 2C, 1)."""

    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[-1]
        mean, std = _statistics(x, torch.full_like(x[:, :1], 1.0 / t))
        context = torch.cat([x, mean[..., None].expand(-1, -1, t),
                             std[..., None].expand(-1, -1, t)], dim=1)
        attention = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _statistics(x, attention)
        return torch.cat([mean, std], dim=1)[..., None]


def _statistics(x: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    mean = (weights * x).sum(2)
    std = torch.sqrt((weights * (x - mean[..., None]).pow(2)).sum(2).clamp(1e-12))
    return mean, std


class Qwen3TTSSpeakerEncoder(nn.Module):
    def __init__(self, cfg: SpeakerEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ch, k, d = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        self.blocks = nn.ModuleList([TimeDelayNetBlock(cfg.mel_dim, ch[0], k[0], d[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(SqueezeExcitationRes2NetBlock(
                ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels, k[i], d[i]))
        self.mfa = TimeDelayNetBlock(ch[-1], ch[-1], k[-1], d[-1])
        self.asp = AttentiveStatisticsPooling(ch[-1], cfg.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, cfg.enc_dim)

    def forward(self, mels: Tensor) -> Tensor:
        """mels (B, T, mel_dim) -> (B, enc_dim)."""
        h = mels.transpose(1, 2)
        outs = []
        for block in self.blocks:
            h = block(h)
            outs.append(h)
        h = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(h))[..., 0]

    @torch.inference_mode()
    def embed_speaker(self, wav: Tensor) -> Tensor:
        """24 kHz audio (N,) -> its x-vector (enc_dim,)."""
        w = self.fc.weight
        return self(log_mel(wav.to(w.device), self.cfg.sample_rate)[None].to(w.dtype))[0]

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> Qwen3TTSSpeakerEncoder:
        """From a Base checkpoint's folder, strictly; dtype None: the checkpoint's."""
        path = Path(path)
        cfg = Qwen3TTSConfig.from_pretrained(path)
        if cfg.speaker_encoder is None:
            raise ValueError(f"{path}: a {cfg.model_type} checkpoint has no speaker encoder "
                             "(only Base models clone voices)")
        model = load_component(lambda: cls(cfg.speaker_encoder), path, CHECKPOINT_PREFIX,
                               device, dtype, {})
        return model.requires_grad_(False)
