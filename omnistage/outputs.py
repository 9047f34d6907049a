"""What callers get back: one `OmniOutput` per request, with its metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass(slots=True)
class RequestMetrics:
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
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    hidden_states: dict[int, Tensor] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
