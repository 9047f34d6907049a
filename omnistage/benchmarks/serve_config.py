"""What `omnistage bench serve` is asked (`ServeBenchConfig`, the routes and metrics it knows)
and what it records of one request (`Sample`); serve.py sends the requests, serve_report.py
sums them up."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
          "chat-audio": "/v1/chat/completions", "speech": "/v1/audio/speech",
          "images": "/v1/images/generations"}
ALIASES = {"openai-chat": "chat", "openai": "completions", "vllm": "completions"}  # vLLM's names
METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency",
           "ttfa": "Time to First Audio", "rtf": "Real-time Factor"}
DEFAULT_METRICS = {"chat": ("ttft", "tpot", "itl", "e2el"),
                   "completions": ("ttft", "tpot", "itl", "e2el"),
                   "chat-audio": ("ttft", "ttfa", "rtf", "e2el"),
                   "speech": ("ttfa", "rtf", "e2el"), "images": ("e2el",)}
DEFAULT_INPUT_WORDS = {"chat": 1024, "completions": 1024, "chat-audio": 64, "speech": 32,
                       "images": 16}
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city name "
         "river music light tree garden window market table road paper voice color").split()


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint_type: str = "chat"
    endpoint: str | None = None              # the route's path (default: the type's)
    model: str | None = None                 # None: the first of /v1/models
    num_prompts: int = 100
    max_concurrency: int | None = None       # None: no bound
    request_rate: float = math.inf           # requests per second; inf: all at once
    seed: int = 0
    random_input_len: int | None = None      # words (default: by endpoint type)
    random_output_len: int = 128             # max_tokens of text routes
    prompt: str | None = None                # the same prompt for every request
    ignore_eos: bool = True                  # vLLM's extra field: every answer max_tokens long
    api_key: str | None = None
    timeout_s: float = 600.0                 # per request, all of it
    voice: str | None = None
    audio_format: str = "wav"                # speech: wav or pcm
    audio_sample_rate: int = 24000           # the rate of headerless pcm (OpenAI's pcm16)
    image_size: str | None = None
    percentile_metrics: tuple[str, ...] | None = None   # None: by endpoint type
    metric_percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)

    def __post_init__(self) -> None:
        """Checked here, named by the flag that sets each field."""
        etype = ALIASES.get(self.endpoint_type, self.endpoint_type)
        if etype not in ROUTES:
            raise ValueError(f"--endpoint-type {self.endpoint_type!r}: choose one of "
                             f"{', '.join(ROUTES)}")
        object.__setattr__(self, "endpoint_type", etype)
        checks = [
            (self.base_url.startswith(("http://", "https://")),
             f"--base-url {self.base_url!r}: expected http://HOST:PORT or https://..."),
            (self.num_prompts >= 1, f"--num-prompts {self.num_prompts}: must be >= 1"),
            (self.max_concurrency is None or self.max_concurrency >= 1,
             f"--max-concurrency {self.max_concurrency}: must be >= 1"),
            (self.request_rate > 0, f"--request-rate {self.request_rate}: must be > 0"),
            (self.random_input_len is None or self.random_input_len >= 1,
             f"--random-input-len {self.random_input_len}: must be >= 1"),
            (self.random_output_len >= 1,
             f"--random-output-len {self.random_output_len}: must be >= 1"),
            (self.timeout_s > 0, f"--timeout {self.timeout_s}: must be > 0"),
            (self.audio_format in ("wav", "pcm"),
             f"--audio-format {self.audio_format!r}: wav or pcm (the lengths read here)"),
            (self.audio_sample_rate > 0, f"--audio-sample-rate {self.audio_sample_rate}: > 0"),
            (all(m in METRICS for m in self.metrics),
             f"--percentile-metrics {','.join(self.metrics)}: choose from {','.join(METRICS)}"),
            (all(0 < p <= 100 for p in self.metric_percentiles),
             f"--metric-percentiles {self.metric_percentiles}: each in (0, 100]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def metrics(self) -> tuple[str, ...]:
        return self.percentile_metrics or DEFAULT_METRICS[self.endpoint_type]

    @property
    def root(self) -> str:
        """The server's root: a trailing / and /v1 dropped (both spellings are common)."""
        url = self.base_url.rstrip("/")
        return url.removesuffix("/v1")


@dataclass(slots=True)
class Sample:
    """One request, timed from when it was sent (seconds)."""
    index: int
    prompt_words: int
    start_s: float = 0.0                     # when it was sent, after the benchmark's start
    success: bool = False
    error: str = ""
    latency_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    first_audio_s: float | None = None
    audio_s: float = 0.0
    images: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def rtf(self) -> float | None:
        return self.latency_s / self.audio_s if self.audio_s > 0 else None


class RequestFailed(Exception):
    """The server answered, but not with what the route promises."""
