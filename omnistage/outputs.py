"""What callers get back: one `OmniOutput` per request, with its metrics."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from PIL import Image

    from omnistage.engine.orchestrator import RequestEvent


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
    the final tensor outputs concatenated. Streaming updates also carry what they added."""

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
    tensors: dict[str, Tensor] = field(default_factory=dict)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    stage_metrics: dict[str, dict] = field(default_factory=dict)
    progress: float | None = None      # share of the work done (diffusion steps), when known
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

    def snapshot(self, ev: RequestEvent) -> OmniOutput:
        snap = copy.copy(self)
        snap.token_ids = list(self.token_ids)
        snap.metrics = copy.copy(self.metrics)
        snap.stage = ev.stage or None
        snap.delta_text = ev.text
        snap.delta_token_ids = list(ev.token_ids)
        snap.delta_tensors = dict(ev.tensors or {})
        return snap
