"""`omnistage bench serve` against real servers (this package's: the tiny Qwen3 behind an API
key, the demo image model; a toy TTS of its own): the labelled table is printed, the JSON holds
a sample per request and a summary whose numbers agree with them. Failures (a wrong key, a
server that never answers) are counted with their first error, never raised. No timing is
asserted, only orderings that hold at any speed (TTFT <= E2E) and exact amounts of work."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from omnistage.entrypoints.cli.main import main

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

PROMPT_WORDS = 12
OUTPUT_TOKENS = 5


def bench(tmp_path: Path, server_url: str, *extra: str) -> tuple[int, dict]:
    rc = main(["bench", "serve", "--base-url", server_url, "--result-dir", str(tmp_path),
               "--result-filename", "run.json", *extra])
    return rc, json.loads((tmp_path / "run.json").read_text())     # strict JSON: no inf / nan


def finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x >= 0


def test_chat_streamed_table_and_json(text_server: Server, tmp_path: Path,
                                      capsys: pytest.CaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The key from $OPENAI_API_KEY, the model from /v1/models; tokens from the usage chunk."""
    from tests.system.entrypoints.openai.conftest import CHAT_MODEL, KEY

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    rc, doc = bench(tmp_path, text_server.url + "/v1", "--num-prompts", "6",
                    "--max-concurrency", "2", "--random-input-len", str(PROMPT_WORDS),
                    "--random-output-len", str(OUTPUT_TOKENS))
    out = capsys.readouterr().out
    assert rc == 0, out
    for label in ("============ Serving Benchmark Result ============", "Successful requests:",
                  "Benchmark duration (s):", "Request throughput (req/s):",
                  "Output token throughput (tok/s):", "Mean TTFT (ms):", "Median TTFT (ms):",
                  "P99 TTFT (ms):", "Mean TPOT (ms):", "P90 ITL (ms):", "Mean E2EL (ms):"):
        assert label in out, label
    assert doc["model"] == CHAT_MODEL and doc["endpoint"] == "/v1/chat/completions"
    assert "api_key" not in doc["config"] and KEY not in json.dumps(doc)
    summary, samples = doc["summary"], doc["samples"]
    assert summary["completed"] == 6 and summary["failed"] == 0 and len(samples) == 6
    for s in samples:
        assert s["success"] and s["prompt_words"] == PROMPT_WORDS
        assert s["output_tokens"] == OUTPUT_TOKENS       # ignore_eos: max_tokens each
        assert s["prompt_tokens"] >= PROMPT_WORDS
        assert 0 < s["ttft_s"] <= s["latency_s"]
        assert len(s["itl_s"]) <= OUTPUT_TOKENS - 1 and all(finite(x) for x in s["itl_s"])
        assert math.isclose(s["tpot_s"], (s["latency_s"] - s["ttft_s"]) / (OUTPUT_TOKENS - 1))
    assert summary["total_output_tokens"] == 6 * OUTPUT_TOKENS
    assert summary["total_input_tokens"] == sum(s["prompt_tokens"] for s in samples)
    assert math.isclose(summary["output_throughput"],
                        6 * OUTPUT_TOKENS / summary["duration_s"])
    ttft_ms = [1000 * s["ttft_s"] for s in samples]
    assert math.isclose(summary["mean_ttft_ms"], float(np.mean(ttft_ms)))
    assert math.isclose(summary["p90_ttft_ms"], float(np.percentile(ttft_ms, 90)))
    assert summary["median_ttft_ms"] <= summary["p99_ttft_ms"] <= max(ttft_ms) + 1e-9
    assert summary["mean_ttft_ms"] <= summary["mean_e2el_ms"]


def test_completions_poisson_arrivals_and_fixed_prompt(text_server: Server, tmp_path: Path
                                                       ) -> None:
    from tests.system.entrypoints.openai.conftest import KEY

    rc, doc = bench(tmp_path, text_server.url, "--endpoint-type", "completions",
                    "--api-key", KEY, "--num-prompts", "4", "--request-rate", "50",
                    "--prompt", "one two three", "--random-output-len", "3",
                    "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9")
    assert rc == 0 and doc["summary"]["completed"] == 4
    assert doc["config"]["request_rate"] == 50 and doc["summary"]["request_rate"] == 50
    starts = [s["start_s"] for s in doc["samples"]]
    assert starts == sorted(starts) and starts[-1] > 0           # spaced arrivals, in order
    assert all(s["output_tokens"] == 3 and s["prompt_words"] == 3 for s in doc["samples"])
    assert {k for k in doc["summary"] if k.startswith("p")} == {
        "p50_ttft_ms", "p99.9_ttft_ms", "p50_e2el_ms", "p99.9_e2el_ms"}


def test_images(image_server: Server, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The demo model draws digits: a prompt that names one (random words would be a 400)."""
    rc, doc = bench(tmp_path, image_server.url, "--endpoint-type", "images",
                    "--prompt", "a handwritten 4", "--num-prompts", "3", "--max-concurrency", "3")
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Image throughput (images/s):" in out and "Mean E2EL (ms):" in out
    summary = doc["summary"]
    assert doc["model"] == "omnistage-demo" and summary["completed"] == 3
    assert summary["total_images"] == 3 and all(s["images"] == 1 for s in doc["samples"])
    assert math.isclose(summary["image_throughput"], 3 / summary["duration_s"])
    assert all(0 < s["latency_s"] <= summary["duration_s"] for s in doc["samples"])


@pytest.fixture(scope="module")
def tts_server(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
               ) -> Server:
    from omnistage.testing.toy_tts import build_toy_tts

    ckpt, graph = build_toy_tts(tmp_path_factory.mktemp("toy_tts"), step_delay_s=0.01)
    return start_server([str(ckpt), "--stage-config", str(graph)])


@pytest.mark.parametrize("fmt", ["wav", "pcm"])
def test_speech_first_audio_and_rtf(tts_server: Server, tmp_path: Path, fmt: str) -> None:
    """The toy speaks each character as 10 ms of tone: the seconds of audio read from the
    streamed bytes are exact."""
    from omnistage.testing.toy_tts import RATE, SAMPLES_PER_CHAR

    text = "Seven short words make one request."
    rc, doc = bench(tmp_path, tts_server.url, "--endpoint-type", "speech", "--prompt", text,
                    "--num-prompts", "3", "--audio-format", fmt,
                    "--audio-sample-rate", str(RATE))
    assert rc == 0 and doc["summary"]["completed"] == 3
    for s in doc["samples"]:
        assert math.isclose(s["audio_s"], len(text) * SAMPLES_PER_CHAR / RATE)
        assert 0 < s["first_audio_s"] <= s["latency_s"]
        assert math.isclose(s["rtf"], s["latency_s"] / s["audio_s"])
    assert set(doc["config"]["percentile_metrics"]) == {"ttfa", "rtf", "e2el"}
    assert doc["summary"]["median_rtf"] > 0 and doc["summary"]["p99_ttfa_ms"] > 0


def test_failures_are_counted_with_their_first_error(text_server: Server, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    rc, doc = bench(tmp_path, text_server.url, "--model", "tiny-chat", "--api-key", "wrong",
                    "--num-prompts", "3", "--random-input-len", "4")
    out = capsys.readouterr().out
    assert rc == 1
    assert doc["summary"]["completed"] == 0 and doc["summary"]["failed"] == 3
    assert doc["summary"]["first_error"].startswith("request 0: HTTP 401")
    assert "3 of 3 requests failed; the first, request 0: HTTP 401" in out
    assert "Failed requests:                         3" in out
    assert doc["summary"]["mean_ttft_ms"] is None and "n/a" in out


def test_chat_audio_transcript_and_pcm16(omni_server: Server, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    """The tiny Qwen3-Omni (24 kHz, ignore_eos on its thinker): a transcript of max_tokens and
    pcm16 pieces in delta.audio, the first audio after the first text."""
    rc, doc = bench(tmp_path, omni_server.url, "--endpoint-type", "chat-audio",
                    "--num-prompts", "2", "--random-input-len", "5",
                    "--random-output-len", "4")
    out = capsys.readouterr().out
    assert rc == 0, out
    for label in ("Mean TTFT (ms):", "Mean TTFA (ms):", "Median RTF:", "Audio throughput"):
        assert label in out, label
    assert doc["model"] == "tiny-omni" and doc["summary"]["completed"] == 2
    for s in doc["samples"]:
        assert 0 < s["ttft_s"] <= s["first_audio_s"] <= s["latency_s"]
        assert s["audio_s"] > 0 and math.isclose(s["rtf"], s["latency_s"] / s["audio_s"])
        assert s["output_tokens"] > 0
    assert math.isclose(doc["summary"]["total_audio_s"],
                        sum(s["audio_s"] for s in doc["samples"]))
