"""The server of a full-duplex model (Moshi): `omnistage serve <moshi folder>` builds this app
over a `DuplexRuntime` in the server's process (entrypoints/cli/serve.py `serve_duplex`).

    WS  /v1/duplex              a session (connection.py); `?resume=1` takes a dropped one back
    WS  /v1/realtime            the same session (vLLM-Omni opens its duplex sessions there,
                                `?duplex=1`; on this server every realtime session is duplex)
    GET /health, /v1/models     as the other servers answer them (the API key, when set, as
                                theirs: every path but /health, /metrics with --open-metrics)
    GET /metrics                Prometheus text: live sessions, ticks, missed ticks and inputs
                                (in all, and per live session), the tick latency histogram
    GET /, /playground/NAME     the playground (playground.py) with its Duplex tab, which the
                                card's `capabilities` turn on (`--no-playground`: none)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import FastAPI, WebSocket
from fastapi.responses import JSONResponse, Response

from omnistage.engine.duplex import LATENCY_BUCKETS_S, DuplexRuntime
from omnistage.entrypoints.openai.duplex.connection import DuplexConnection
from omnistage.entrypoints.openai.errors import install_error_handlers
from omnistage.entrypoints.openai.middleware import APIKeyCheck
from omnistage.entrypoints.openai.playground import add_playground, duplex_capabilities
from omnistage.entrypoints.openai.realtime.resume import Sessions, is_resume, resume

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class DuplexLimits:
    resume_grace_s: float = 30.0      # a dropped socket's session waits this long (0: none)
    max_chunk_bytes: int = 256 << 10  # PCM16 bytes one append may carry (5.5 s at 24 kHz)

    def __post_init__(self) -> None:
        if self.resume_grace_s < 0 or self.max_chunk_bytes < 2:
            raise ValueError(f"duplex limits {self}: grace >= 0 s, chunks >= 2 bytes")


def build_duplex_app(runtime: DuplexRuntime, model_name: str,
                     limits: DuplexLimits = DuplexLimits(), api_key: str | None = None,
                     open_metrics: bool = False, enable_playground: bool = True) -> FastAPI:
    app = FastAPI(title="omnistage duplex")
    install_error_handlers(app)          # a wrong path or file: OpenAI's error JSON
    if enable_playground:
        add_playground(app)
    # the other servers' key check: Bearer header, or OpenAI's browser subprotocol
    app.add_middleware(APIKeyCheck, api_key=api_key, open_metrics=open_metrics)
    sessions = Sessions()
    created = int(time.time())

    @app.websocket("/v1/duplex")
    @app.websocket("/v1/realtime")      # vLLM-Omni's duplex sessions: /v1/realtime?duplex=1
    async def duplex(ws: WebSocket) -> None:
        if is_resume(ws):
            await resume(ws, sessions)
        else:
            await DuplexConnection(ws, runtime, model_name, sessions, limits.resume_grace_s,
                                   limits.max_chunk_bytes).run()

    @app.get("/health")
    async def health() -> Response:
        alive = runtime.is_alive
        return JSONResponse({"status": "ok" if alive else "unavailable"},
                            status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        # the shape of the other servers' cards, so the playground reads it as theirs: audio
        # in, speech and the inner monologue's text out, served on /v1/duplex only
        return JSONResponse({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "omnistage",
            "modalities": ["audio", "text"], "capabilities": duplex_capabilities()}]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(metrics_text(runtime, model_name), media_type=CONTENT_TYPE)

    return app


def metrics_text(runtime: DuplexRuntime, model_name: str) -> str:
    t, label = runtime.totals, f'model_name="{model_name}"'
    lines = [
        "# HELP omnistage_duplex_sessions Duplex sessions holding a slot now.",
        "# TYPE omnistage_duplex_sessions gauge",
        f"omnistage_duplex_sessions{{{label}}} {len(runtime.live)}",
        "# HELP omnistage_duplex_max_sessions The most duplex sessions served at once.",
        "# TYPE omnistage_duplex_max_sessions gauge",
        f"omnistage_duplex_max_sessions{{{label}}} {runtime.max_sessions}"]
    for name, value, what in (
            ("ticks", t.ticks, "Batched duplex steps run."),
            ("missed_ticks", t.missed_ticks, "Session-ticks whose step ended after the next "
                                             "tick was due."),
            ("missed_inputs", t.missed_inputs, "Session-ticks that heard silence: no client "
                                               "audio had come.")):
        lines += [f"# HELP omnistage_duplex_{name}_total {what}",
                  f"# TYPE omnistage_duplex_{name}_total counter",
                  f"omnistage_duplex_{name}_total{{{label}}} {value}"]
    lines += ["# HELP omnistage_duplex_session_missed_ticks Missed ticks of each live session.",
              "# TYPE omnistage_duplex_session_missed_ticks gauge"]
    lines += [f'omnistage_duplex_session_missed_ticks{{{label},session_id="{sid}"}} '
              f"{s.stats.missed_ticks}" for sid, s in list(runtime.live.items())]
    lines += ["# HELP omnistage_duplex_tick_latency_seconds Wall time of a batched step.",
              "# TYPE omnistage_duplex_tick_latency_seconds histogram"]
    for bound, count in zip(LATENCY_BUCKETS_S, t.latency_buckets):
        lines.append(f'omnistage_duplex_tick_latency_seconds_bucket{{{label},le="{bound}"}} '
                     f"{count}")
    lines += [f'omnistage_duplex_tick_latency_seconds_bucket{{{label},le="+Inf"}} '
              f"{t.latency_count}",
              f"omnistage_duplex_tick_latency_seconds_sum{{{label}}} {t.latency_sum_s:.6f}",
              f"omnistage_duplex_tick_latency_seconds_count{{{label}}} {t.latency_count}"]
    return "\n".join(lines) + "\n"
