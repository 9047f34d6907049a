"""The server's log lines about its work:

    one per finished request (logger omnistage.requests), at INFO (WARNING when it failed in
    the engine):
      request chatcmpl-1f.. model=tiny-chat stages=llm prompt_tokens=24 output_tokens=8
        ttft=0.031s e2e=0.094s status=length
    one per stage (logger omnistage.stats), at most every 10 s and only when something
    changed there:
      stage llm: 2 running, 0 waiting, 310.2 prompt tok/s, 85.0 gen tok/s,
        prefix cache hits 50.0%, KV cache 4.7%
      stage dit: 1 running, 0 waiting, 12.5 steps/s
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable

from starlette.concurrency import run_in_threadpool

from omnistage.entrypoints.openai.metrics import request_status

if TYPE_CHECKING:
    from omnistage.outputs import OmniOutput
    from omnistage.stages.messages import StageStats

logger = logging.getLogger("omnistage.requests")
stats_logger = logging.getLogger("omnistage.stats")


def log_request(out: OmniOutput, model_name: str, status: str | None = None) -> None:
    """The request's line; `status` given when the server ends it (a disconnect: abort)."""
    status = status or request_status(out)
    m = out.metrics
    fields = [f"request {out.request_id}", f"model={model_name}",
              f"stages={','.join(out.stage_metrics) or '-'}"]
    if m.num_prompt_tokens or m.num_output_tokens:    # an image request has no tokens
        fields += [f"prompt_tokens={m.num_prompt_tokens}",
                   f"output_tokens={m.num_output_tokens}"]
    if out.pixels is not None:
        fields.append(f"images={out.pixels.shape[0]}")
    if out.audio is not None and out.sample_rate:
        fields.append(f"audio={out.audio.size / out.sample_rate:.2f}s")
    fields += [f"ttft={_seconds(m.time_to_first_token)}",
               f"e2e={_seconds(m.e2e_latency or time.time() - m.arrival_time)}",
               f"status={status}"]
    if out.error:
        fields.append(f"error={out.error!r}")
    logger.log(logging.WARNING if status == "error" else logging.INFO, " ".join(fields))


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


class StageStatsLog:
    """Turns successive StageStats of every stage into log lines: rates from the totals'
    change since the previous poll, a line only for a stage where something changed since
    its last line (an idle server stays quiet)."""

    def __init__(self) -> None:
        self.previous: dict[str, tuple[float, StageStats]] = {}
        self.logged: dict[str, tuple] = {}

    def lines(self, stats: dict[str, StageStats], now: float) -> list[str]:
        out = []
        for stage, st in sorted(stats.items()):
            before = self.previous.get(stage)
            self.previous[stage] = (now, st)
            key = _state(st)
            if self.logged.get(stage) == key:
                continue
            self.logged[stage] = key
            out.append(stage_line(stage, st, before, now))
        return out


def _state(st: StageStats) -> tuple:
    e = st.engine
    return (e.num_running, e.num_waiting, st.num_steps, st.num_output_tokens,
            e.num_computed_tokens, e.num_prefix_query_tokens, e.num_preemptions)


def stage_line(stage: str, st: StageStats, before: tuple[float, StageStats] | None = None,
               now: float | None = None) -> str:
    """One stage's line: its load now and, given the stats of an earlier poll (`before`: its
    time and stats) and this one's time, the rates since then."""
    e = st.engine
    parts = [f"{e.num_running} running", f"{e.num_waiting} waiting"]
    if before is not None and now is not None and now > before[0]:
        seconds, prev = now - before[0], before[1]
        p = prev.engine
        tokens = st.num_output_tokens - prev.num_output_tokens
        if e.num_blocks is not None:      # AR: tokens in, tokens out
            prompt = max(0, e.num_computed_tokens - p.num_computed_tokens - tokens)
            parts += [f"{prompt / seconds:.1f} prompt tok/s", f"{tokens / seconds:.1f} gen tok/s"]
        else:
            parts.append(f"{(st.num_steps - prev.num_steps) / seconds:.1f} steps/s")
        queries = e.num_prefix_query_tokens - p.num_prefix_query_tokens
        if queries > 0:
            hits = e.num_prefix_hit_tokens - p.num_prefix_hit_tokens
            parts.append(f"prefix cache hits {100 * hits / queries:.1f}%")
        if e.num_preemptions > p.num_preemptions:
            parts.append(f"{e.num_preemptions - p.num_preemptions} preemptions")
    if e.kv_usage is not None:
        parts.append(f"KV cache {100 * e.kv_usage:.1f}%")
    return f"stage {stage}: " + ", ".join(parts)


async def log_stage_stats(fetch: Callable[[], dict[str, StageStats]], interval_s: float
                          ) -> None:
    """Poll every stage's stats at once (each stage's first line: its state at start, and the
    base of the next line's rates), then each `interval_s` (a worker thread waits for the
    answers), logging the lines of the stages that changed; runs until cancelled (the app's
    shutdown)."""
    log = StageStatsLog()
    while True:
        try:
            stats = await run_in_threadpool(fetch)
        except TimeoutError as exc:
            # a stage answers between steps, so one in a long step (a big diffusion step, a
            # first compile) is silent here; a hung one is the liveness watch's to report
            stats_logger.debug("%s (a stage in a long step answers after it)", exc)
        else:
            for line in log.lines(stats, time.monotonic()):
                stats_logger.info(line)
        await asyncio.sleep(interval_s)
