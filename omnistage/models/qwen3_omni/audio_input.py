"""Audio inputs of Qwen3-Omni requests: decoding an audio file's bytes to a mono waveform, and
`resample`, our windowed-sinc resampler (Hann window, 6 zero crossings, 0.99 roll-off:
torchaudio's default) to the feature extractor's 16 kHz."""

from __future__ import annotations

import io
import math

import numpy as np
import torch
import torch.nn.functional as F


def load_audio(data: bytes) -> tuple[np.ndarray, int]:
    """Decode an audio file's bytes (wav, flac, ogg, mp3, ... as libsndfile reads them) to a
    mono float32 waveform and its sample rate."""
    import soundfile

    if not data:
        raise ValueError("audio: no bytes to decode")
    try:
        waveform, sample_rate = soundfile.read(io.BytesIO(data), dtype="float32",
                                               always_2d=True)
    except (soundfile.SoundFileError, RuntimeError, TypeError) as e:
        raise ValueError(f"audio: cannot decode {len(data)} bytes as an audio file ({e})") from None
    return waveform.mean(axis=1), int(sample_rate)              # (frames, ch) -> (frames,)


def resample(waveform: np.ndarray, orig_sr: int, target_sr: int, zero_crossings: int = 6,
             rolloff: float = 0.99) -> np.ndarray:
    """Band-limited resampling of a 1-D waveform: a Hann-windowed sinc low-pass at
    rolloff * min(orig_sr, target_sr) / 2, evaluated as a polyphase filter bank (one filter per
    output phase, applied with a strided conv). Output length ceil(len * target / orig)."""
    if orig_sr <= 0 or target_sr <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_sr} -> {target_sr}")
    if orig_sr == target_sr:
        return waveform.astype(np.float32, copy=False)
    g = math.gcd(orig_sr, target_sr)
    up, down = target_sr // g, orig_sr // g        # every `down` inputs make `up` outputs
    cutoff = min(up, down) * rolloff               # in units of the reduced input rate
    half_width = math.ceil(zero_crossings * down / cutoff)   # filter half-length, input samples

    # phase p (output sample p of each block) sits at input offset p * down / up
    taps = torch.arange(-half_width, half_width + down, dtype=torch.float64) / down
    t = (taps[None, :] - torch.arange(up, dtype=torch.float64)[:, None] / up) * cutoff
    t = t.clamp(-zero_crossings, zero_crossings)
    window = torch.cos(t * math.pi / zero_crossings / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, 1, t))
    kernels = (sinc * window * cutoff / down).float()          # (up, taps)

    x = torch.from_numpy(np.ascontiguousarray(waveform, dtype=np.float32))
    x = F.pad(x[None, None], (half_width, half_width + down))   # (1, 1, n + pad)
    y = F.conv1d(x, kernels[:, None, :], stride=down)            # (1, up, blocks)
    y = y[0].T.reshape(-1)                                       # interleave the phases
    return y[: math.ceil(up * waveform.shape[0] / down)].numpy()
