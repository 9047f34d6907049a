"""Audio inputs of Qwen3-Omni requests: decoding an audio file's bytes to a mono waveform, and
(utils/audio.py's `resample`, re-exported) resampling it to the feature extractor's 16 kHz."""

from __future__ import annotations

import io

import numpy as np

from omnistage.utils.audio import resample

__all__ = ["load_audio", "resample"]


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
