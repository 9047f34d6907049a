"""Operations: /metrics after real traffic (vLLM's names next to ours), client errors kept out
of the engine-error count, the per-request log line, and the per-stage stats line.

The scrapes use the package's two servers (the tiny chat model, the digits demo); the log lines
need the app in this process, over one tiny engine of the module's own."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from omnistage.engine.async_omni import AsyncOmni
from omnistage.entrypoints.openai.log_lines import log_request, log_stage_stats
from omnistage.entrypoints.openai.metrics import ServerMetrics
from omnistage.errors import StageError
from omnistage.outputs import CompletionOutput, OmniOutput, RequestMetrics, StageMetrics

if TYPE_CHECKING:
    pass

CHAT = "tiny-chat"      # the text server's --served-model-name (conftest)
DEMO = "omnistage-demo"
USER = [{"role": "user", "content": "What is the capital of France?"}]


def value(metrics: dict, name: str, **labels: str) -> float | None:
    return metrics.get((name, tuple(sorted(labels.items()))))


# ---- log lines, the app in this process ----------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_qwen3: Path) -> Iterator[AsyncOmni]:
    engine = AsyncOmni(str(tiny_qwen3), device="cpu", max_model_len=256)
    yield engine
    engine.shutdown()


def test_a_stage_busy_in_a_long_step_is_not_logged_as_a_problem(
        caplog: pytest.LogCaptureFixture) -> None:
    """A stage answers stats between steps: during a long step it cannot. That used to log
    `stage stats: stage stats: no answer from ['dit']` as a warning every interval, which
    reads as a hang; it is a debug line now."""
    caplog.set_level(logging.DEBUG, logger="omnistage.stats")

    def busy() -> dict:
        raise TimeoutError("stage stats: no answer from ['dit']")

    async def run_for(seconds: float) -> None:
        task = asyncio.create_task(log_stage_stats(busy, 0.05))
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run_for(0.3))
    records = [r for r in caplog.records if r.name == "omnistage.stats"]
    assert records and all(r.levelno == logging.DEBUG for r in records), records
    assert all(r.getMessage().count("stage stats:") == 1 for r in records)


def test_audio_seconds_rtf_and_engine_errors_per_stage() -> None:
    """What a speech request adds (no speech model needed: the output as the engine hands it
    over), and which failures count as the engine's."""
    metrics = ServerMetrics("omni", {"thinker": "text", "code2wav": "audio"})
    t0 = 1000.0
    done = CompletionOutput(text="Hello", token_ids=[5, 6, 7], finished=True,
                            finish_reason="stop", tensors={"audio": torch.zeros(48000)})
    speech = OmniOutput("r1", "hi", [1, 2], [done], finished=True,
                        metrics=RequestMetrics(t0, t0 + 0.1, t0 + 0.2, t0 + 0.5, 2, 3),
                        stage_metrics={s: StageMetrics() for s in ("thinker", "talker", "code2wav")},
                        sample_rate=24000)
    metrics.observe_finished(speech)
    ended = RequestMetrics(t0, finished_time=t0 + 0.05)
    failed = OmniOutput("r2", "hi", [1], [_errored()], finished=True,
                        error=StageError("talker", "internal", "boom"), metrics=ended)
    refused = OmniOutput("r3", "hi", [1], [_errored()], finished=True,
                         error=StageError("talker", "invalid_input", "bad speaker", "speaker"),
                         metrics=ended)
    metrics.observe_finished(failed)
    metrics.observe_finished(refused)
    m = {(s.name, tuple(sorted(s.labels.items()))): s.value
         for fam in text_string_to_metric_families(metrics.render({}, True, 0).decode())
         for s in fam.samples}
    stage = {"model_name": "omni", "stage": "code2wav"}
    assert value(m, "omnistage_audio_seconds_total", **stage) == 2.0      # 48000 at 24 kHz
    assert value(m, "omnistage_audio_rtf_count", **stage) == 1
    assert value(m, "omnistage_audio_rtf_sum", **stage) == pytest.approx(0.25)   # 0.5 s / 2 s
    assert value(m, "vllm:time_per_output_token_seconds_sum", model_name="omni") \
        == pytest.approx(0.15)                                           # (0.5 - 0.2) / 2
    assert value(m, "omnistage_engine_errors_total", model_name="omni", stage="talker") == 1
    assert value(m, "omnistage_requests_finished_total", finish_reason="invalid_input") == 1
    assert value(m, "omnistage_requests_finished_total", finish_reason="error") == 1
    # latency of the speech and of the failure; the refused request had none of the engine
    assert value(m, "vllm:e2e_request_latency_seconds_count", model_name="omni") == 2


def _errored() -> CompletionOutput:
    return CompletionOutput(finished=True, finish_reason="error")


def test_an_image_request_line_names_images_not_tokens(caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    done = CompletionOutput(finished=True, finish_reason="stop",
                            tensors={"images": torch.zeros(2, 8, 8, 3, dtype=torch.uint8)})
    out = OmniOutput("img-1", "a 7", [], [done], finished=True,
                     metrics=RequestMetrics(1000.0, 1000.1, 1000.2, 1000.3),
                     stage_metrics={"dit": StageMetrics()})
    with caplog.at_level(logging.INFO, logger="omnistage.requests"):
        log_request(out, "demo")
    (line,) = [r.getMessage() for r in caplog.records if r.name == "omnistage.requests"]
    assert "images=2" in line and "stages=dit" in line and "tokens" not in line, line
