"""The voice a request asks a speaking stage for, under one name whatever the family:
`SamplingParams.extra["voice"]` (OpenAI's word, Qwen3-TTS's), with `"speaker"` (Qwen-Omni's
older word) taken as the same key. A speaking stage names the other `extra` keys it reads; any
key it does not read is refused, so a misspelt option fails instead of being ignored. A
reference clip ("ref_audio", or one of VibeVoice's "voices") is read by `reference_waveform`,
shared by the families that clone at 24 kHz."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch
from torch import Tensor

from omnistage.errors import InputError
from omnistage.payloads import SAMPLE_RATE
from omnistage.utils.audio import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, resample

VOICE_KEYS = ("voice", "speaker")


def requested_voice(extra: Mapping[str, object], takes: Iterable[str] = ()) -> str | None:
    """The voice named in `extra` (None: none named); InputError for a key outside
    VOICE_KEYS + `takes`, or for `voice` and `speaker` naming different voices."""
    takes = tuple(takes)
    unknown = set(extra) - set(takes) - set(VOICE_KEYS)
    if unknown:
        raise InputError(f"extra: unknown keys {sorted(unknown)} (this model's speaking stage "
                         f"takes "
                         f"{', '.join((*VOICE_KEYS, *takes))})", param=min(unknown))
    return voice_of(extra)


def voice_of(extra: Mapping[str, object]) -> str | None:
    """The voice named in `extra` (None: none), checking only that `voice` and `speaker`, if
    both are given, agree (the front door's check: every stage's params carry it)."""
    given = [str(extra[k]) for k in VOICE_KEYS if extra.get(k) is not None]
    if len({g.lower() for g in given}) > 1:
        raise InputError(f"voice {given[0]!r} and speaker {given[1]!r} name different voices "
                         "(they are one key: give one)", param="voice")
    return given[0] if given else None


def reference_waveform(value: object, rate: int = 24000, param: str = "ref_audio") -> Tensor:
    """A request's reference clip -> float32 (num_samples,) at `rate`: samples at `rate` as
    they are (a list of floats), or {"samples": little-endian float32 bytes, "sample_rate": r}
    (the speech API's) resampled; InputError naming `param` for anything else."""
    if not isinstance(value, dict):
        return torch.as_tensor(value, dtype=torch.float32).reshape(-1)
    try:
        samples = np.frombuffer(value["samples"], dtype="<f4")
        given = int(value[SAMPLE_RATE])
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{param}: expected samples at {rate // 1000} kHz or {{samples: float32 "
                         f"bytes, sample_rate}} ({exc})", param=param) from None
    if not MIN_SAMPLE_RATE <= given <= MAX_SAMPLE_RATE:
        raise InputError(f"{param}: sample_rate {given} Hz is outside {MIN_SAMPLE_RATE} to "
                         f"{MAX_SAMPLE_RATE} Hz", param=param)
    return torch.from_numpy(resample(samples, given, rate).copy())
