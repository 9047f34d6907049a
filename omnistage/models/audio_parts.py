"""Audio parts of requests (chat's input_audio, a prompt's audio), shared by the families that
hear: an audio file's bytes decoded to a mono waveform (`load_audio`), and a part checked and
made a mono float32 waveform at the model's rate (`part_waveform`; utils/audio.py's
`resample`, re-exported)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from torch import Tensor

from omnistage.utils.audio import check_sample_rate, resample

__all__ = ["load_audio", "part_waveform", "resample"]


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


def part_waveform(part: dict[str, Any], where: str, target_rate: int, min_samples: int = 1
                  ) -> np.ndarray:
    """A part's "audio" (file bytes, (waveform, rate), or a waveform with "sample_rate") as
    a mono float32 waveform at `target_rate`; ValueError naming `where`'s field otherwise."""
    audio = part.get("audio")
    sample_rate = part.get("sample_rate", part.get("sampling_rate"))
    if isinstance(audio, (bytes, bytearray)):
        try:
            audio, sample_rate = load_audio(bytes(audio))
        except ValueError as e:
            raise ValueError(f"{where}.{e}") from None
    elif isinstance(audio, tuple) and len(audio) == 2:
        audio, sample_rate = audio
    if sample_rate is None:
        raise ValueError(f"{where}.sample_rate: needed with a raw waveform")
    if not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
        raise ValueError(f"{where}.sample_rate: expected a positive int, got {sample_rate!r}")
    check_sample_rate(int(sample_rate), f"{where}.sample_rate")
    if isinstance(audio, Tensor):
        audio = audio.detach().cpu().numpy()
    try:
        waveform = np.asarray(audio, dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError(f"{where}.audio: expected a float waveform, (waveform, sample_rate) "
                         f"or audio file bytes, got {type(audio).__name__}") from None
    if waveform.ndim != 1:
        raise ValueError(f"{where}.audio: expected a 1-D (mono) waveform, got shape "
                         f"{waveform.shape}")
    if waveform.size == 0:
        raise ValueError(f"{where}.audio: empty waveform")
    if not np.isfinite(waveform).all():
        raise ValueError(f"{where}.audio: waveform has NaN or infinite samples")
    waveform = resample(waveform, int(sample_rate), target_rate)
    if waveform.shape[0] < min_samples:
        raise ValueError(f"{where}.audio: too short ({waveform.shape[0]} samples at "
                         f"{target_rate} Hz, need at least {min_samples})")
    return waveform
