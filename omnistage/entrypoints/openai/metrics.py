"""Prometheus metrics of the server, in a registry of its own (one per app, so that two apps in
one process never share counters).

    per request    omnistage_http_requests_total{route,status}, omnistage_requests_in_flight,
                   time to first token / first audio chunk, end-to-end latency, tokens/s,
                   prompt and generated token counters
    per stage      omnistage_stage_step_seconds{stage}: the time per engine step a request saw
                   there (AR: between its tokens; diffusion: per denoising step)
                   omnistage_stage_time_seconds{stage}: time from arrival in the stage to done
    at scrape      omnistage_stage_queue_length{stage} (requests the stage holds, waiting or
                   running), omnistage_stage_kv_blocks{stage,state} (free / total),
                   omnistage_engine_healthy
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

if TYPE_CHECKING:
    from omnistage.outputs import OmniOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_STEP = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SPEED = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("omnistage_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.in_flight = Gauge("omnistage_requests_in_flight",
                               "requests admitted and not yet finished", registry=r)
        self.ttft = Histogram("omnistage_time_to_first_token_seconds",
                              "arrival to the first output (token or tensor)", buckets=_LATENCY,
                              registry=r)
        self.ttfa = Histogram("omnistage_time_to_first_audio_seconds",
                              "arrival to the first audio chunk", buckets=_LATENCY, registry=r)
        self.e2e = Histogram("omnistage_e2e_request_latency_seconds",
                             "arrival to the last output", buckets=_LATENCY, registry=r)
        self.speed = Histogram("omnistage_request_tokens_per_second",
                               "decode speed of a request (tokens after the first)",
                               buckets=_SPEED, registry=r)
        self.prompt_tokens = Counter("omnistage_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("omnistage_generation_tokens", "generated tokens",
                                         registry=r)
        self.finished = Counter("omnistage_requests_finished", "engine requests by finish reason",
                                ["finish_reason"], registry=r)
        self.stage_step = Histogram("omnistage_stage_step_seconds",
                                    "time per engine step a request saw in a stage",
                                    ["stage"], buckets=_STEP, registry=r)
        self.stage_time = Histogram("omnistage_stage_time_seconds",
                                    "arrival in a stage to done there", ["stage"],
                                    buckets=_LATENCY, registry=r)
        self.queue_length = Gauge("omnistage_stage_queue_length",
                                  "requests a stage holds (waiting or running)", ["stage"],
                                  registry=r)
        self.engine_requests = Gauge("omnistage_stage_engine_requests",
                                     "requests in a stage's engine", ["stage"], registry=r)
        self.kv_blocks = Gauge("omnistage_stage_kv_blocks", "KV-cache blocks of a stage",
                               ["stage", "state"], registry=r)
        self.healthy = Gauge("omnistage_engine_healthy", "1 while every stage is alive",
                             registry=r)

    # -- per request -----------------------------------------------------------------------------
    def observe_first_audio(self, out: OmniOutput) -> None:
        import time

        self.ttfa.observe(max(0.0, time.time() - out.metrics.arrival_time))

    def observe_finished(self, out: OmniOutput) -> None:
        m = out.metrics
        self.finished.labels(out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(m.num_output_tokens)
        for value, hist in ((m.time_to_first_token, self.ttft), (m.e2e_latency, self.e2e),
                            (m.tokens_per_s, self.speed)):
            if value is not None:
                hist.observe(value)
        for stage, sm in out.stage_metrics.items():
            step = step_time(sm)
            if step is not None:
                self.stage_step.labels(stage).observe(step)
            if sm.get("time_in_stage") is not None:
                self.stage_time.labels(stage).observe(float(sm["time_in_stage"]))

    # -- at scrape -------------------------------------------------------------------------------
    def render(self, stage_stats: dict[str, object] | None, healthy: bool,
               num_in_flight: int) -> bytes:
        self.healthy.set(1 if healthy else 0)
        self.in_flight.set(num_in_flight)
        for name, st in (stage_stats or {}).items():
            self.queue_length.labels(name).set(getattr(st, "num_requests", 0))
            self.engine_requests.labels(name).set(getattr(st, "num_engine_requests", 0))
            if getattr(st, "num_blocks", None) is not None:
                self.kv_blocks.labels(name, "free").set(st.num_free_blocks)
                self.kv_blocks.labels(name, "total").set(st.num_blocks)
        return generate_latest(self.registry)


def step_time(sm: dict) -> float | None:
    """Seconds per engine step of one request in one stage, from the stage's metrics."""
    if sm.get("denoise_time") is not None and sm.get("num_steps"):
        return float(sm["denoise_time"]) / int(sm["num_steps"])
    first, done, n = sm.get("first_output_time"), sm.get("finished_time"), sm.get("num_outputs")
    if first is None or done is None or not n or n < 2:
        return None
    return (float(done) - float(first)) / (int(n) - 1)
