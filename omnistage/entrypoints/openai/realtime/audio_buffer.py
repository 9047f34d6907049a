"""The session's input audio buffer: float32 samples at the model's rate (LISTEN_RATE, 16 kHz,
whatever rate the client sends) on the session's timeline (sample 0 is the first ever
appended), kept as the appended chunks so that a long turn costs no quadratic copying; only the
tail from `start` on is held."""

from __future__ import annotations

import base64
import binascii

import numpy as np

from omnistage.entrypoints.openai.errors import bad_request
from omnistage.entrypoints.openai.realtime.protocol import LISTEN_RATE
from omnistage.utils.audio import check_sample_rate, resample


class AudioBuffer:
    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.start = 0          # timeline index of the first held sample
        self.end = 0            # timeline index after the last appended sample

    @property
    def num_samples(self) -> int:
        return self.end - self.start

    def append(self, samples: np.ndarray) -> None:
        self.chunks.append(samples)
        self.end += len(samples)

    def take(self, until: int | None = None) -> np.ndarray:
        """The held samples up to timeline index `until` (None: all), removed from the buffer."""
        until = self.end if until is None else min(max(until, self.start), self.end)
        whole = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)
        cut = until - self.start
        head, rest = whole[:cut], whole[cut:]
        self.chunks, self.start = ([rest] if len(rest) else []), until
        return head

    def drop_before(self, index: int) -> None:
        """Forget the samples before timeline index `index`."""
        while self.chunks and self.start + len(self.chunks[0]) <= index:
            self.start += len(self.chunks.pop(0))
        if self.chunks and index > self.start:
            self.chunks[0] = self.chunks[0][index - self.start:]
            self.start = index

    def clear(self) -> None:
        self.chunks, self.start = [], self.end


def ms_to_samples(ms: int) -> int:
    return ms * LISTEN_RATE // 1000


def samples_to_ms(n: int) -> int:
    return n * 1000 // LISTEN_RATE


def decode_pcm16(b64: object, rate: int, param: str) -> np.ndarray:
    """Base64 PCM16 mono little-endian at `rate` (the session's input rate: 24 kHz unless it
    declares another) -> float32 samples at the model's LISTEN_RATE (16 kHz)."""
    if not isinstance(b64, str):
        raise bad_request(f"{param}: base64 PCM16 audio (a string) is required", param)
    try:
        check_sample_rate(rate, f"{param}: the input rate")
    except ValueError as exc:
        raise bad_request(str(exc), param, "invalid_audio") from None
    try:
        data = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}: not valid base64", param, "invalid_audio") from None
    if len(data) % 2:
        raise bad_request(f"{param}: PCM16 audio has an even number of bytes, got {len(data)}",
                          param, "invalid_audio")
    samples = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    return resample(samples, rate, LISTEN_RATE) if rate != LISTEN_RATE else samples
