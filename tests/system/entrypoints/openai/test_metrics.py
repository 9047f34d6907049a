"""Operations: /metrics after real traffic (vLLM's names next to ours), client errors kept out
of the engine-error count, the per-request log line, and the per-stage stats line.

The scrapes use the package's two servers (the tiny chat model, the digits demo); the log lines
need the app in this process, over one tiny engine of the module's own."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import httpx
import pytest

from omnistage.engine.async_omni import AsyncOmni
from omnistage.entrypoints.openai.api_server import ServerConfig, build_app
from omnistage.entrypoints.openai.log_lines import StageStatsLog, log_stage_stats

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

CHAT = "tiny-chat"      # the text server's --served-model-name (conftest)
DEMO = "omnistage-demo"
USER = [{"role": "user", "content": "What is the capital of France?"}]


def value(metrics: dict, name: str, **labels: str) -> float | None:
    return metrics.get((name, tuple(sorted(labels.items()))))


def test_metrics_after_chat_traffic(text_server: Server) -> None:
    text_server.openai().chat.completions.create(model=CHAT, messages=USER, max_tokens=6,
                                                 extra_body={"ignore_eos": True})
    m = text_server.metrics()
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count",
                 "vllm:request_queue_time_seconds_count"):
        assert value(m, name, model_name=CHAT) >= 1, name
    assert value(m, "vllm:generation_tokens_total", model_name=CHAT) >= 6
    assert value(m, "vllm:request_success_total", model_name=CHAT, finished_reason="length") >= 1
    stage = {"model_name": CHAT, "stage": "llm"}
    assert value(m, "vllm:num_requests_running", **stage) == 0      # present, and idle now
    assert value(m, "vllm:num_requests_waiting", **stage) == 0
    assert value(m, "vllm:kv_cache_usage_perc", **stage) is not None
    assert value(m, "vllm:prefix_cache_queries_total", **stage) > 0   # prompt tokens looked up
    assert value(m, "vllm:prefix_cache_hits_total", **stage) is not None
    assert value(m, "vllm:num_preemptions_total", **stage) is not None
    assert value(m, "omnistage_stage_steps_total", **stage) >= 6
    # the older names still there
    assert value(m, "omnistage_time_to_first_token_seconds_count") >= 1
    assert value(m, "omnistage_stage_kv_blocks", stage="llm", state="total") > 0


def test_metrics_after_image_traffic(image_server: Server) -> None:
    before = image_server.metrics()
    image_server.openai().images.generate(prompt="a 3", n=2,
                                          extra_body={"num_inference_steps": 3, "seed": 0})
    m = image_server.metrics()
    stage = {"model_name": DEMO, "stage": "dit"}
    grew = lambda name: (value(m, name, **stage) or 0) - (value(before, name, **stage) or 0)  # noqa: E731
    assert grew("omnistage_images_total") == 2
    assert grew("omnistage_diffusion_steps_total") >= 3
    assert value(m, "vllm:e2e_request_latency_seconds_count", model_name=DEMO) >= 1
    assert value(m, "vllm:num_requests_running", **stage) == 0
    assert value(m, "vllm:kv_cache_usage_perc", **stage) is None    # no KV cache there


def test_client_errors_are_not_engine_errors(servers: dict[str, Server]) -> None:
    text, image = servers["text"], servers["image"]
    before = {name: s.metrics() for name, s in servers.items()}
    # refused at the front door, and refused by the diffusion stage itself (no digit named)
    assert text.post("/v1/chat/completions", json={"model": CHAT, "messages": USER,
                                                   "temperature": -1}).status_code == 400
    refused = image.post("/v1/images/generations", json={"prompt": "a cat"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_input"
    for name, server in servers.items():
        m, b = server.metrics(), before[name]
        errors = [k for k in m if k[0] == "omnistage_engine_errors_total"]
        assert all(m[k] == b.get(k, 0) for k in errors), errors
        failed = ("omnistage_requests_finished_total", (("finish_reason", "error"),))
        assert m.get(failed, 0) == b.get(failed, 0)
    after = image.metrics()
    rejected = ("omnistage_requests_finished_total", (("finish_reason", "invalid_input"),))
    assert after[rejected] == before["image"].get(rejected, 0) + 1
    latency = ("vllm:e2e_request_latency_seconds_count", (("model_name", DEMO),))
    assert after.get(latency, 0) == before["image"].get(latency, 0)   # no engine latency


# ---- log lines, the app in this process ----------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_qwen3: Path) -> Iterator[AsyncOmni]:
    engine = AsyncOmni(str(tiny_qwen3), device="cpu", max_model_len=256)
    yield engine
    engine.shutdown()


def chat(engine: AsyncOmni, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        app = build_app(engine, ServerConfig(served_model_name=CHAT))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json=body, timeout=60)

    return asyncio.run(go())


def test_one_log_line_per_finished_request(engine: AsyncOmni,
                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="omnistage.requests")
    r = chat(engine, {"model": CHAT, "messages": USER, "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    (record,) = [rec for rec in caplog.records if rec.name == "omnistage.requests"]
    line = record.getMessage()
    fields = dict(f.split("=", 1) for f in line.split()[2:])
    assert line.startswith(f"request {r.json()['id']} "), line
    assert fields["model"] == CHAT and fields["stages"] == "llm"
    assert fields["prompt_tokens"] == str(r.json()["usage"]["prompt_tokens"])
    assert fields["output_tokens"] == "5" and fields["status"] == "length"
    assert float(fields["ttft"].rstrip("s")) > 0
    assert float(fields["e2e"].rstrip("s")) >= float(fields["ttft"].rstrip("s"))


def test_a_refused_request_is_logged_with_its_reason(engine: AsyncOmni,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="omnistage.requests")
    r = chat(engine, {"model": CHAT, "messages": USER, "max_tokens": -3})
    assert r.status_code == 400, r.text
    r = chat(engine, {"model": CHAT, "messages": USER, "temperature": "hot"})
    assert r.status_code == 400, r.text
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "omnistage.requests"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("refused POST /v1/chat/completions: 400 "), lines
    assert "max_tokens" in lines[0], lines
    assert "temperature" in lines[1], lines


def test_stage_stats_line_only_when_something_changed(engine: AsyncOmni) -> None:
    log = StageStatsLog()
    stats = lambda: engine.orchestrator.stage_stats(10.0)  # noqa: E731
    log.lines(stats(), time.monotonic())              # the first poll: a line, no rates yet
    assert log.lines(stats(), time.monotonic()) == []  # idle: nothing changed, no line
    assert chat(engine, {"model": CHAT, "messages": USER, "max_tokens": 8,
                         "ignore_eos": True}).status_code == 200
    (line,) = log.lines(stats(), time.monotonic())
    assert line.startswith("stage llm: 0 running, 0 waiting, ") and "KV cache 0.0%" in line
    gen = float(line.split(" gen tok/s")[0].rsplit(" ", 1)[1])
    prompt = float(line.split(" prompt tok/s")[0].rsplit(" ", 1)[1])
    assert gen > 0 and prompt > 0 and "prefix cache hits" in line, line


def test_the_stats_task_stays_quiet_while_idle(engine: AsyncOmni,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """The server's task (run by the app's lifespan) polls every interval; an idle stage gets
    the first poll's line and no more."""
    caplog.set_level(logging.INFO, logger="omnistage.stats")

    async def run_for(seconds: float) -> None:
        task = asyncio.create_task(
            log_stage_stats(lambda: engine.orchestrator.stage_stats(10.0), 0.05))
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run_for(0.6))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stage ")]
    assert lines == ["stage llm: 0 running, 0 waiting, KV cache 0.0%"], lines

