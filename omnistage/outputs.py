"""What callers get back: one `OmniOutput` per request, with its completions and metrics."""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch
from torch import Tensor

from omnistage.errors import StageError
from omnistage.payloads import AUDIO, SAMPLE_RATE, AudioChunk, Images, Video
from omnistage.utils.audio import encode_audio

if TYPE_CHECKING:
    from PIL import Image

# file extension -> encode_audio format (opus goes in an Ogg container)
AUDIO_EXTENSIONS = {".wav": "wav", ".flac": "flac", ".mp3": "mp3", ".ogg": "opus",
                    ".opus": "opus"}
REPR_CHARS = 60   # how much of the text a repr shows


@dataclass(slots=True)
class RequestEvent:
    """What the orchestrator tells a request's sink: one stage's output, and whether the whole
    request is now done (finished, failed or aborted). `tensors`: the packed payload the
    stage sent the client (payloads.py's records read it)."""

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
    error: StageError | None = None    # why the request failed (kind, stage, message, param)
    stage_metrics: dict[str, StageMetrics] | None = None
    index: int = 0                     # which of the request's n completions it belongs to


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


class StageMetrics(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One request's record in one stage, sent when it finishes there (`OmniOutput.
    stage_metrics[stage]`). Times are wall clocks (comparable across processes), durations in
    seconds. The worker fills the first block; the engine of the stage's kind, the rest (None:
    not that kind's)."""

    arrival_time: float = 0.0
    first_output_time: float | None = None
    finished_time: float | None = None
    time_in_stage: float | None = None
    time_to_first_output: float | None = None
    num_tokens: int = 0                       # tokens it produced
    num_outputs: int = 0                      # steps that produced something
    connector_bytes_in: int = 0
    connector_bytes_out: int = 0
    connector_seconds: float = 0.0
    queue_time: float | None = None           # arrival to its first scheduled step
    num_prompt_tokens: int | None = None      # AR
    num_cached_tokens: int = 0                # AR: prompt tokens from the prefix cache
    num_preemptions: int = 0                  # AR
    prompt_ready_time: float | None = None    # Qwen3-Omni's talker: its prompt handed over,
    prompt_rows_time: float | None = None     # its prompt rows all received (since add)
    num_steps: int | None = None              # diffusion: denoising steps run,
    num_steps_skipped: int | None = None      # of them skipped by the step cache
    denoise_time: float | None = None
    conditioning_wait_time: float | None = None   # waiting for a text-encoder stage
    encode_time: float | None = None          # text-encoder stage
    num_batched_requests: int | None = None   # text-encoder stage: its batch
    num_chunks: int | None = None             # generation: chunks it produced
    model_seconds: float | None = None        # generation: forwards it took part in
    # fields of the request this stage accepted and did not use (a Qwen-Image guidance_scale):
    # the server names them in X-Omnistage-Ignored
    ignored: tuple[str, ...] = ()


@dataclass(slots=True, repr=False)
class CompletionOutput:
    """One of a request's completions (`SamplingParams.n` of them; vLLM's name): what it made
    so far (text, token ids, logprobs; once finished, its final tensors with `audio` and
    `images` views) and, on a streaming update, what that update added to it."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None   # stop | length | abort | error
    tensors: dict[str, Tensor] = field(default_factory=dict)
    sample_rate: int | None = None     # Hz of `audio`; the request's rate (OmniOutput's)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_tensors: dict[str, Tensor] = field(default_factory=dict)
    tensor_chunks: dict[str, list[Tensor]] = field(default_factory=dict)

    @property
    def images(self) -> list[Image.Image]:
        """The final images as PIL images (from `pixels`)."""
        return _images(self.pixels)

    @property
    def pixels(self) -> Tensor | None:
        """The final images, uint8 (n, H, W, C); None until finished, and when there are
        none."""
        images = Images.unpack(self.tensors)
        return None if images is None else images.pixels

    @property
    def video_frames(self) -> Tensor | None:
        """The final videos' frames, uint8 (n, F, H, W, 3), which a graph whose last stage
        says `final: video` makes; None until finished, and when there are none."""
        video = Video.unpack(self.tensors)
        return None if video is None else video.frames

    @property
    def video(self) -> np.ndarray | None:
        """The final video's frames, uint8 (F, H, W, 3) (the first of `video_frames`); None
        until finished, and when there is none."""
        frames = self.video_frames
        return None if frames is None else frames[0].numpy()

    def save_video(self, path: str | os.PathLike[str], fps: float) -> None:
        """Write the final video at `fps` (the request's DiffusionParams.fps, or the model's
        VideoSpec.fps); the extension picks the format: .mp4, .webm, .webp, .gif."""
        from omnistage.utils.video import FORMATS, encode_video

        fmt = Path(path).suffix.lower().lstrip(".")
        if fmt not in FORMATS:
            raise ValueError(f"save_video: unknown extension {fmt or '(none)'!r} in "
                             f"{os.fspath(path)!r}; supported: {', '.join(FORMATS)}")
        if self.video is None:
            raise ValueError(f"completion {self.index} has no video (unfinished, or the model "
                             "makes none)")
        Path(path).write_bytes(encode_video(self.video, fps, fmt))  # type: ignore[arg-type]

    @property
    def audio(self) -> np.ndarray | None:
        """The final waveform at `sample_rate`, float32 (num_samples,), nominally in [-1, 1]
        (a view of the AudioChunk samples); None until finished, and when there is no audio."""
        return _as_numpy(_samples(self.tensors))

    @property
    def delta_audio(self) -> np.ndarray | None:
        """The samples this streaming update added (float32), or None."""
        return _as_numpy(_samples(self.delta_tensors))

    @property
    def delta_samples(self) -> Tensor | None:
        """The samples this streaming update added, as the tensor it carried, or None."""
        return _samples(self.delta_tensors)

    @property
    def has_delta(self) -> bool:
        """Whether this update added anything to this completion."""
        return bool(self.delta_text or self.delta_token_ids or self.delta_tensors)

    def save_audio(self, path: str | os.PathLike[str]) -> None:
        """Write the final audio; the extension picks the format: .wav / .flac (16-bit PCM),
        .mp3, .ogg / .opus (Opus in Ogg)."""
        _save_audio(self, path, f"completion {self.index}")

    def __repr__(self) -> str:
        return f"CompletionOutput(index={self.index}, {_describe(self)})"


def _first(name: str, settable: bool = False) -> property:
    """`OmniOutput.<name>`: the first completion's attribute (read, and set where the engine
    tests fill outputs by hand)."""
    def get(self: OmniOutput) -> object:
        return getattr(self.outputs[0], name)

    def put(self: OmniOutput, value: object) -> None:
        setattr(self.outputs[0], name, value)

    return property(get, put if settable else None, doc=f"outputs[0].{name}")


@dataclass(slots=True, repr=False)
class OmniOutput:
    """A request's output: its prompt, its completions (`outputs`, one unless
    `SamplingParams.n` asked for more), whether all of them finished, the request's error and
    metrics. `text`, `token_ids`, `logprobs`, `finish_reason`, `tensors`, `audio`, `images`,
    `save_audio` and the streaming deltas (`delta_text`, `delta_tensors`, `delta_audio`) are
    those of the first completion, `outputs[0]`: what a request with n=1 reads.

    `error` is the request's failure, typed (payloads and the error have one encoding each:
    `str(error)` is the line a person reads). `tensors` stays as the raw view of the final
    payload (public API; the typed accessors `audio`, `images`, `pixels`, `video` read it)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=lambda: [CompletionOutput()])
    finished: bool = False
    # the first error of any completion: which stage, what kind (invalid_input / internal /
    # stage_dead / aborted / timeout), its message and the field it names (what the server
    # answers from)
    error: StageError | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    stage_metrics: dict[str, StageMetrics] = field(default_factory=dict)
    progress: float | None = None      # share of the work done (diffusion steps), when known
    # Hz of the audio stage serving the request, set from the first update on (a player can
    # open its device before the first samples); None: the request makes no audio
    sample_rate: int | None = None
    stage: str | None = None           # the stage the latest update came from (streaming)
    index: int = 0                     # the completion the latest update added to

    def __post_init__(self) -> None:
        for c in self.outputs:
            c.sample_rate = c.sample_rate or self.sample_rate

    # -- the first completion, as a request with n=1 reads it -----------------------------------
    text = _first("text", settable=True)
    token_ids = _first("token_ids", settable=True)
    logprobs = _first("logprobs", settable=True)
    finish_reason = _first("finish_reason", settable=True)
    tensors = _first("tensors", settable=True)
    delta_text = _first("delta_text")
    delta_token_ids = _first("delta_token_ids")
    delta_tensors = _first("delta_tensors")
    images = _first("images")
    pixels = _first("pixels")
    video = _first("video")
    video_frames = _first("video_frames")
    audio = _first("audio")
    delta_audio = _first("delta_audio")

    @property
    def error_info(self) -> StageError | None:
        """`error` (its old name, kept for callers of the public API)."""
        return self.error

    @property
    def invalid_input(self) -> bool:
        """Whether the error is the request's fault (a stage refused its input)."""
        return self.error is not None and self.error.is_invalid_input

    def save_video(self, path: str | os.PathLike[str], fps: float) -> None:
        """Write the (first completion's) final video (see CompletionOutput.save_video)."""
        self.outputs[0].save_video(path, fps)

    def save_audio(self, path: str | os.PathLike[str]) -> None:
        """Write the (first completion's) final audio; the extension picks the format:
        .wav / .flac (16-bit PCM), .mp3, .ogg / .opus (Opus in Ogg)."""
        _save_audio(self.outputs[0], path, f"request {self.request_id!r}")

    @property
    def has_delta(self) -> bool:
        """Whether this streaming update added text, tokens or tensors to any completion."""
        return any(c.has_delta for c in self.outputs)

    def apply(self, ev: RequestEvent) -> OmniOutput:
        """Fold one event of the orchestrator into the request's totals (its completion
        `ev.index`); return a snapshot carrying the deltas."""
        now = time.time()
        m = self.metrics
        c = self.outputs[ev.index]
        if ev.token_ids:
            c.token_ids.extend(ev.token_ids)
            m.num_output_tokens += len(ev.token_ids)
        if ev.token_ids or ev.tensors:
            m.first_token_time = m.first_token_time or now
        c.text += ev.text
        if ev.progress is not None:
            self.progress = ev.progress
        if ev.logprobs:
            c.logprobs = (c.logprobs or []) + ev.logprobs
        for k, v in (ev.tensors or {}).items():
            c.tensor_chunks.setdefault(k, []).append(v)
        audio = AudioChunk.unpack(ev.tensors or {})
        if audio is not None and audio.sample_rate is not None:   # a stage may send its rate
            self.sample_rate = audio.sample_rate                  # with the samples
            for each in self.outputs:
                each.sample_rate = self.sample_rate
        if ev.stage_finished and ev.finish_reason and c.finish_reason is None:
            c.finish_reason = ev.finish_reason     # the first final stage to finish says why
        if ev.done:
            self._finish(c, ev, now)
        return self.snapshot(ev)

    def _finish(self, c: CompletionOutput, ev: RequestEvent, now: float) -> None:
        """Completion `c` is done (finished, failed or aborted); the request, once all are."""
        c.finished = True
        c.finish_reason = c.finish_reason or ev.finish_reason or "stop"
        if ev.error:
            c.finish_reason = "error"
            if self.error is None:      # the request's error: the first completion's to fail
                self.error = ev.error
        if ev.finish_reason == "abort":
            c.finish_reason = "abort"
        # chunks join along dim 0; a scalar (a sample rate, an fps) is the last one sent
        c.tensors = {k: v[-1] if v[-1].dim() == 0 else torch.cat(v)
                     for k, v in c.tensor_chunks.items()}
        c.tensor_chunks = {}
        m = self.metrics
        stage_metrics = ev.stage_metrics or {}
        if ev.index == 0 or not self.stage_metrics:
            self.stage_metrics = stage_metrics
        for sm in stage_metrics.values():
            m.num_cached_tokens += sm.num_cached_tokens
            m.num_preemptions += sm.num_preemptions
            if sm.queue_time is not None:   # the earliest: the entry stage's
                start = sm.arrival_time + sm.queue_time
                if m.first_scheduled_time is None or start < m.first_scheduled_time:
                    m.first_scheduled_time = start
        self.finished = all(each.finished for each in self.outputs)
        if self.finished:
            m.finished_time = now

    def snapshot(self, ev: RequestEvent) -> OmniOutput:
        """A copy for the caller, with this event's additions as the deltas of its completion
        (the others' deltas empty): later events do not change it."""
        snap = copy.copy(self)
        snap.outputs = [copy.copy(c) for c in self.outputs]
        for c in snap.outputs:
            c.token_ids = list(c.token_ids)
            c.delta_text, c.delta_token_ids, c.delta_tensors = "", [], {}
            c.tensor_chunks = {}
        snap.metrics = copy.copy(self.metrics)
        snap.stage = ev.stage or None
        snap.index = ev.index
        updated = snap.outputs[ev.index]
        updated.delta_text = ev.text
        updated.delta_token_ids = list(ev.token_ids)
        updated.delta_tensors = dict(ev.tensors or {})
        return snap

    def __repr__(self) -> str:
        more = f", n={len(self.outputs)}" if len(self.outputs) > 1 else ""
        err = f", error={_clip(str(self.error))}" if self.error else ""
        return (f"OmniOutput(request_id={self.request_id!r}, finished={self.finished}, "
                f"{_describe(self.outputs[0])}{more}{err})")


def _describe(c: CompletionOutput) -> str:
    """The short middle of a repr: why it finished, the text's start, sizes, never tensors."""
    parts = [f"finish_reason={c.finish_reason!r}", f"text={_clip(c.text)}",
             f"token_ids=[{len(c.token_ids)} ids]"]
    if c.delta_text:
        parts.append(f"delta_text={_clip(c.delta_text)}")
    for name, t in {**c.tensors, **{f"delta_{k}": v for k, v in c.delta_tensors.items()}}.items():
        if name.endswith(SAMPLE_RATE):
            continue
        rate = f" @ {c.sample_rate} Hz" if name.endswith(AUDIO) and c.sample_rate else ""
        parts.append(f"{name}={tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}{rate}")
    return ", ".join(parts)


def _clip(text: str, limit: int = REPR_CHARS) -> str:
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} chars)"


def _images(pixels: Tensor | None) -> list[Image.Image]:
    from PIL import Image

    if pixels is None:
        return []
    arrays = pixels.numpy()
    return [Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a) for a in arrays]


def _save_audio(c: CompletionOutput, path: str | os.PathLike[str], who: str) -> None:
    suffix = Path(path).suffix.lower()
    fmt = AUDIO_EXTENSIONS.get(suffix)
    if fmt is None:
        raise ValueError(f"save_audio: unknown extension {suffix or '(none)'!r} in "
                         f"{os.fspath(path)!r}; supported: {', '.join(AUDIO_EXTENSIONS)}")
    wave = c.audio
    if wave is None:
        if not c.finished:
            raise ValueError(f"{who} has not finished: its audio is on the final output "
                             "(streaming updates carry delta_audio)")
        raise ValueError(f"{who} produced no audio (e.g. it asked for text only)")
    if c.sample_rate is None:
        raise ValueError(f"{who}: the sample rate of its audio is unknown (the audio stage "
                         "reported none); set sample_rate first")
    Path(path).write_bytes(encode_audio(wave, c.sample_rate, fmt))


def _samples(tensors: dict[str, Tensor]) -> Tensor | None:
    audio = AudioChunk.unpack(tensors)
    return None if audio is None else audio.samples


def _as_numpy(t: Tensor | None) -> np.ndarray | None:
    # .numpy() on a CPU float32 tensor shares its memory: no copy of a long waveform
    return None if t is None else t.detach().cpu().float().numpy()
