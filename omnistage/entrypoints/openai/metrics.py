"""Prometheus metrics of the server, in a registry of its own (one per app, so that two apps in
one process never share counters). vLLM's names (`vllm:*`, label `model_name`, and `stage`
where the value is one stage's) next to our own (`omnistage_*`).

    per request   vllm:time_to_first_token_seconds, vllm:time_per_output_token_seconds (the
                  request's mean), vllm:e2e_request_latency_seconds,
                  vllm:request_queue_time_seconds, vllm:prompt_tokens / generation_tokens,
                  vllm:request_success{finished_reason};
                  omnistage_engine_errors{stage} (failed in the engine; a request a stage
                  refused as invalid is the client's fault and counts as finish_reason
                  "invalid_input" instead), audio: omnistage_audio_seconds{stage},
                  omnistage_audio_rtf{stage} (the request's e2e time over the seconds of audio
                  it got); diffusion: omnistage_images{stage}, omnistage_diffusion_steps{stage};
                  and the older omnistage_* ones: omnistage_http_requests{route,status},
                  omnistage_requests_in_flight, time to first token / first audio chunk,
                  e2e latency, tokens/s, prompt and generated tokens,
                  omnistage_stage_step_seconds{stage}, omnistage_stage_time_seconds{stage};
                  realtime: omnistage_realtime_turn_taking_seconds{decided_by} (speech_stopped
                  to commit: silence / score / max_wait), omnistage_realtime_end_of_turn_score
    at scrape     (each stage's StageStats, asked for when /metrics is read)
                  vllm:num_requests_running{stage}, vllm:num_requests_waiting{stage},
                  AR stages: vllm:kv_cache_usage_perc{stage} (0..1, as vLLM's),
                  vllm:prefix_cache_queries / hits{stage} (prompt tokens),
                  vllm:num_preemptions{stage}; omnistage_stage_steps{stage};
                  omnistage_stage_queue_length{stage}, omnistage_stage_engine_requests{stage},
                  omnistage_stage_kv_blocks{stage,state}, omnistage_engine_healthy,
                  omnistage_replica_outstanding_requests{stage,replica},
                  omnistage_replica_outstanding_steps{stage,replica},
                  omnistage_replica_up{stage,replica}
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from omnistage.outputs import OmniOutput, StageMetrics
    from omnistage.stages.messages import StageStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_STEP = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SPEED = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
_SCORE = (0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
_RTF = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)


def request_status(out: OmniOutput) -> str:
    """How a finished request ended: stop / length / abort, "error" for a failure in the
    engine, "invalid_input" for input a stage refused (the client's fault: a 4xx)."""
    if out.finish_reason == "error" or out.error is not None:
        return "invalid_input" if out.invalid_input else "error"
    return out.finish_reason or "unknown"


class ServerMetrics:
    def __init__(self, model_name: str = "", finals: dict[str, str] | None = None) -> None:
        """`finals`: stage name -> the output kind it sends the client (audio, image, ...)."""
        self.model_name = model_name
        self.finals = dict(finals or {})
        self.registry = r = CollectorRegistry()
        self.stages = StageCollector(model_name)
        r.register(self.stages)
        self._init_omnistage(r)
        self._init_vllm(r)

    def _init_omnistage(self, r: CollectorRegistry) -> None:
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
        self.healthy = Gauge("omnistage_engine_healthy",
                             "1 while every stage has a live replica", registry=r)
        self.replica_outstanding = Gauge("omnistage_replica_outstanding_requests",
                                         "requests routed to a replica, not finished there",
                                         ["stage", "replica"], registry=r)
        self.replica_steps = Gauge("omnistage_replica_outstanding_steps",
                                   "decode / denoising steps its outstanding requests asked "
                                   "for (what the router weighs)", ["stage", "replica"],
                                   registry=r)
        self.replica_up = Gauge("omnistage_replica_up", "1 while a replica takes traffic",
                                ["stage", "replica"], registry=r)
        # realtime turn-taking (realtime/turn.py): speech_stopped to commit, by who decided
        self.turn_taking = Histogram("omnistage_realtime_turn_taking_seconds",
                                     "realtime: the user's speech stopped (VAD) to the turn "
                                     "committed", ["decided_by"], buckets=_LATENCY, registry=r)
        self.end_of_turn_score = Histogram("omnistage_realtime_end_of_turn_score",
                                           "realtime semantic_vad: the model's probability "
                                           "that the user is done", buckets=_SCORE, registry=r)

    def _init_vllm(self, r: CollectorRegistry) -> None:
        """vLLM's names for the same facts (dashboards built for vLLM read them), and ours for
        what vLLM has no name for (audio, images, engine errors)."""
        m, ms = ["model_name"], ["model_name", "stage"]
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds", "arrival to first output",
                                m, buckets=_LATENCY, registry=r)
        self.v_tpot = Histogram("vllm:time_per_output_token_seconds",
                                "a request's mean time per output token after the first", m,
                                buckets=_STEP, registry=r)
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds", "arrival to last output", m,
                               buckets=_LATENCY, registry=r)
        self.v_queue = Histogram("vllm:request_queue_time_seconds",
                                 "arrival to first scheduled in the entry stage", m,
                                 buckets=_LATENCY, registry=r)
        self.v_prompt = Counter("vllm:prompt_tokens", "prompt tokens", m, registry=r)
        self.v_generation = Counter("vllm:generation_tokens", "generated tokens", m, registry=r)
        self.v_success = Counter("vllm:request_success", "requests finished without error",
                                 ["model_name", "finished_reason"], registry=r)
        self.engine_errors = Counter("omnistage_engine_errors",
                                     "requests failed inside the engine (not refused input)",
                                     ms, registry=r)
        self.audio_seconds = Counter("omnistage_audio_seconds", "seconds of audio produced", ms,
                                     registry=r)
        self.audio_rtf = Histogram("omnistage_audio_rtf",
                                   "real-time factor: a request's e2e time / its audio seconds",
                                   ms, buckets=_RTF, registry=r)
        self.images = Counter("omnistage_images", "images produced", ms, registry=r)
        self.diffusion_steps = Counter("omnistage_diffusion_steps",
                                       "denoising steps run for finished requests", ms,
                                       registry=r)

    # -- per request -----------------------------------------------------------------------------
    def observe_first_audio(self, out: OmniOutput) -> None:
        self.ttfa.observe(max(0.0, time.time() - out.metrics.arrival_time))

    def observe_finished(self, out: OmniOutput) -> None:
        m, name = out.metrics, self.model_name
        status = request_status(out)
        self.finished.labels(status).inc()
        if status == "error":
            self.engine_errors.labels(name, out.error.stage if out.error else "").inc()
        elif status != "invalid_input":
            self.v_success.labels(name, status).inc()
        for counter in (self.prompt_tokens, self.v_prompt.labels(name)):
            counter.inc(m.num_prompt_tokens)
        for counter in (self.generation_tokens, self.v_generation.labels(name)):
            counter.inc(m.num_output_tokens)
        if status == "invalid_input":    # refused on arrival: no latency of the engine's
            return
        for value, hists in ((m.time_to_first_token, (self.ttft, self.v_ttft.labels(name))),
                             (m.e2e_latency, (self.e2e, self.v_e2e.labels(name))),
                             (m.tokens_per_s, (self.speed,)),
                             (m.queue_time, (self.v_queue.labels(name),)),
                             (time_per_output_token(out), (self.v_tpot.labels(name),))):
            if value is not None:
                for hist in hists:
                    hist.observe(max(0.0, value))
        for stage, sm in out.stage_metrics.items():
            step = step_time(sm)
            if step is not None:
                self.stage_step.labels(stage).observe(step)
            if sm.time_in_stage is not None:
                self.stage_time.labels(stage).observe(sm.time_in_stage)
            if sm.num_steps:
                self.diffusion_steps.labels(name, stage).inc(sm.num_steps)
        self._observe_media(out)

    def _observe_media(self, out: OmniOutput) -> None:
        """Audio seconds and real-time factor, images: credited to the final stage that made
        them (the request passed through it)."""
        for stage, kind in self.finals.items():
            if stage not in out.stage_metrics:
                continue
            if kind == "audio" and out.sample_rate and out.audio is not None:
                seconds = out.audio.size / out.sample_rate
                self.audio_seconds.labels(self.model_name, stage).inc(seconds)
                if seconds > 0 and out.metrics.e2e_latency is not None:
                    self.audio_rtf.labels(self.model_name, stage).observe(
                        out.metrics.e2e_latency / seconds)
            elif kind == "image" and out.pixels is not None:
                self.images.labels(self.model_name, stage).inc(out.pixels.shape[0])

    # -- at scrape -------------------------------------------------------------------------------
    def render(self, stage_stats: dict[str, StageStats] | None, healthy: bool,
               num_in_flight: int,
               replicas: dict[str, list[dict[str, int | bool]]] | None = None) -> bytes:
        """`replicas`: the orchestrator's replica_status()."""
        self.healthy.set(1 if healthy else 0)
        for stage, states in (replicas or {}).items():
            for st in states:
                self.replica_outstanding.labels(stage, str(st["replica"])).set(st["outstanding"])
                self.replica_steps.labels(stage, str(st["replica"])).set(
                    st.get("outstanding_steps", 0))
                self.replica_up.labels(stage, str(st["replica"])).set(1 if st["live"] else 0)
        self.in_flight.set(num_in_flight)
        self.stages.stats = stage_stats or {}
        for name, st in self.stages.stats.items():
            self.queue_length.labels(name).set(st.num_requests)
            self.engine_requests.labels(name).set(st.num_engine_requests)
            if st.num_blocks is not None and st.num_free_blocks is not None:
                self.kv_blocks.labels(name, "free").set(st.num_free_blocks)
                self.kv_blocks.labels(name, "total").set(st.num_blocks)
        return generate_latest(self.registry)


class StageCollector(Collector):
    """The per-stage series, read from the latest StageStats at each scrape: the values live
    in the stage processes (their counters are totals since the stage started), so they are
    exported as they are rather than mirrored into client-side counters."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, StageStats] = {}

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "stage"]
        running = GaugeMetricFamily("vllm:num_requests_running", "requests running in a stage",
                                    labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting",
                                    "requests waiting in a stage (for a batch slot or input)",
                                    labels=labels)
        steps = CounterMetricFamily("omnistage_stage_steps",
                                    "engine steps of a stage that produced an output",
                                    labels=labels)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc",
                                  "share of an AR stage's KV cache blocks in use (0..1)",
                                  labels=labels)
        queries = CounterMetricFamily("vllm:prefix_cache_queries",
                                      "prompt tokens looked up in the prefix cache",
                                      labels=labels)
        hits = CounterMetricFamily("vllm:prefix_cache_hits",
                                   "prompt tokens found in the prefix cache", labels=labels)
        preemptions = CounterMetricFamily("vllm:num_preemptions",
                                          "running requests sent back to wait for KV blocks",
                                          labels=labels)
        for stage, st in sorted(self.stats.items()):
            key, e = [self.model_name, stage], st.engine
            running.add_metric(key, e.num_running)
            waiting.add_metric(key, e.num_waiting)
            steps.add_metric(key, st.num_steps)
            if e.kv_usage is not None:
                usage.add_metric(key, e.kv_usage)
                queries.add_metric(key, e.num_prefix_query_tokens)
                hits.add_metric(key, e.num_prefix_hit_tokens)
                preemptions.add_metric(key, e.num_preemptions)
        yield from (running, waiting, steps, usage, queries, hits, preemptions)


def time_per_output_token(out: OmniOutput) -> float | None:
    """A request's mean time between output tokens after the first (None below 2 tokens)."""
    m = out.metrics
    if m.first_token_time is None or m.finished_time is None or m.num_output_tokens < 2:
        return None
    return (m.finished_time - m.first_token_time) / (m.num_output_tokens - 1)


def step_time(sm: StageMetrics) -> float | None:
    """Seconds per engine step of one request in one stage, from the stage's metrics."""
    if sm.denoise_time is not None and sm.num_steps:
        return sm.denoise_time / sm.num_steps
    first, done, n = sm.first_output_time, sm.finished_time, sm.num_outputs
    if first is None or done is None or n < 2:
        return None
    return (done - first) / (n - 1)
