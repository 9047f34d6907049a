"""What callers get back: one `OmniOutput` per request, with its metrics."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from torch import Tensor

from omnistage.errors import StageError
from omnistage.utils.audio import encode_audio

if TYPE_CHECKING:
    from PIL import Image

# file extension -> encode_audio format (opus goes in an Ogg container)
AUDIO_EXTENSIONS = {".wav": "wav", ".flac": "flac", ".mp3": "mp3", ".ogg": "opus",
                    ".opus": "opus"}


@dataclass(slots=True)
class RequestEvent:
    """What the orchestrator tells a request's sink: one stage's output, and whether the whole
    request is now done (finished, failed or aborted)."""

    request_id: str
    stage: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    tensors: dict[str, Tensor] | None = None
    logprobs: list[dict[int, float]] | None = None
    progress: float | None = None
    stage_finished: bool = False
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None
    invalid_input: bool = False        # the error is the request's fault (a stage refused it)
    error_info: StageError | None = None   # the error, typed (kind, message alone, param)
    stage_metrics: dict[str, dict] | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Times are wall-clock seconds (time.time()), comparable across stage processes."""

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0     # prompt tokens served by the prefix cache
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed: tokens after the first over the time after the first."""
        if self.first_token_time is None or self.finished_time is None:
            return None
        span = self.finished_time - self.first_token_time
        return (self.num_output_tokens - 1) / span if span > 0 else None

    def as_dict(self) -> dict[str, float | int | None]:
        return {"queue_time": self.queue_time, "time_to_first_token": self.time_to_first_token,
                "e2e_latency": self.e2e_latency, "tokens_per_s": self.tokens_per_s,
                "num_prompt_tokens": self.num_prompt_tokens,
                "num_output_tokens": self.num_output_tokens,
                "num_cached_tokens": self.num_cached_tokens,
                "num_preemptions": self.num_preemptions}


@dataclass(slots=True)
class OmniOutput:
    """A request's output. Totals: text, token_ids, logprobs, and (once finished) `tensors`,
    the final tensor outputs concatenated, with `images` and `audio` views of them. Streaming
    updates also carry what they added (`delta_text`, `delta_tensors`, `delta_audio`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None   # stop | length | abort | error
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    invalid_input: bool = False        # the error: a stage refused the request's input
    # the error, typed: which stage, what kind (invalid_input / internal / stage_dead /
    # aborted), its message alone and the field it names (what the server answers from)
    error_info: StageError | None = None
    tensors: dict[str, Tensor] = field(default_factory=dict)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    stage_metrics: dict[str, dict] = field(default_factory=dict)
    progress: float | None = None      # share of the work done (diffusion steps), when known
    # Hz of the audio stage serving the request, set from the first update on (a player can
    # open its device before the first samples); None: the request makes no audio
    sample_rate: int | None = None
    # what the latest update added (streaming)
    stage: str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_tensors: dict[str, Tensor] = field(default_factory=dict)
    tensor_chunks: dict[str, list[Tensor]] = field(default_factory=dict, repr=False)

    @property
    def images(self) -> list[Image.Image]:
        """The final images as PIL images (from `tensors["images"]`, uint8 (n, H, W, C))."""
        from PIL import Image

        pixels = self.tensors.get("images")
        if pixels is None:
            return []
        arrays = pixels.numpy()
        return [Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a) for a in arrays]

    @property
    def audio(self) -> np.ndarray | None:
        """The final waveform at `sample_rate`, float32 (num_samples,), nominally in [-1, 1]
        (a view of `tensors["audio"]`); None until finished, and when there is no audio."""
        return _as_numpy(self.tensors.get("audio"))

    @property
    def delta_audio(self) -> np.ndarray | None:
        """The samples this streaming update added (float32), or None."""
        return _as_numpy(self.delta_tensors.get("audio"))

    def save_audio(self, path: str | os.PathLike[str]) -> None:
        """Write the final audio; the extension picks the format: .wav / .flac (16-bit PCM),
        .mp3, .ogg / .opus (Opus in Ogg)."""
        suffix = Path(path).suffix.lower()
        fmt = AUDIO_EXTENSIONS.get(suffix)
        if fmt is None:
            raise ValueError(f"save_audio: unknown extension {suffix or '(none)'!r} in "
                             f"{os.fspath(path)!r}; supported: {', '.join(AUDIO_EXTENSIONS)}")
        wave = self.audio
        if wave is None:
            if not self.finished:
                raise ValueError(f"request {self.request_id!r} has not finished: its audio is "
                                 "on the final output (streaming updates carry delta_audio)")
            raise ValueError(f"request {self.request_id!r} produced no audio (e.g. it asked "
                             "for text only)")
        if self.sample_rate is None:
            raise ValueError(f"request {self.request_id!r}: the sample rate of its audio is "
                             "unknown (the audio stage reported none); set sample_rate first")
        Path(path).write_bytes(encode_audio(wave, self.sample_rate, fmt))

    def snapshot(self, ev: RequestEvent) -> OmniOutput:
        snap = copy.copy(self)
        snap.token_ids = list(self.token_ids)
        snap.metrics = copy.copy(self.metrics)
        snap.stage = ev.stage or None
        snap.delta_text = ev.text
        snap.delta_token_ids = list(ev.token_ids)
        snap.delta_tensors = dict(ev.tensors or {})
        return snap


def _as_numpy(t: Tensor | None) -> np.ndarray | None:
    # .numpy() on a CPU float32 tensor shares its memory: no copy of a long waveform
    return None if t is None else t.detach().cpu().float().numpy()
