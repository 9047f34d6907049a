"""`omnistage bench serve` against real servers (this package's: the tiny Qwen3 behind an API
key, the demo image model; a toy TTS of its own): the labelled table is printed, the JSON holds
a sample per request and a summary whose numbers agree with them. Failures (a wrong key, a
server that never answers) are counted with their first error, never raised. No timing is
asserted, only orderings that hold at any speed (TTFT <= E2E) and exact amounts of work."""

from __future__ import annotations

import json
import math
import re
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from omnistage.benchmarks.serve import ServeBenchConfig, percentile, wav_layout
from omnistage.entrypoints.cli.main import main

if TYPE_CHECKING:
    pass

PROMPT_WORDS = 12
OUTPUT_TOKENS = 5


def bench(tmp_path: Path, server_url: str, *extra: str) -> tuple[int, dict]:
    rc = main(["bench", "serve", "--base-url", server_url, "--result-dir", str(tmp_path),
               "--result-filename", "run.json", *extra])
    return rc, json.loads((tmp_path / "run.json").read_text())     # strict JSON: no inf / nan


@pytest.fixture
def silent_server() -> Iterator[str]:
    """Accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    sock.close()


def test_every_request_has_a_deadline(silent_server: str, tmp_path: Path) -> None:
    rc, doc = bench(tmp_path, silent_server, "--model", "m", "--num-prompts", "2",
                    "--timeout", "0.5", "--random-input-len", "3")
    assert rc == 1 and doc["summary"]["failed"] == 2
    assert all("0.5 s" in s["error"] or "Timeout" in s["error"] for s in doc["samples"])
    assert all(s["latency_s"] < 30 for s in doc["samples"])     # bounded, not a timing


def test_bad_flags_name_themselves() -> None:
    for kw, name in (({"num_prompts": 0}, "--num-prompts 0"),
                     ({"request_rate": 0}, "--request-rate 0"),
                     ({"endpoint_type": "embeddings"}, "--endpoint-type 'embeddings'"),
                     ({"percentile_metrics": ("ttft", "foo")}, "--percentile-metrics ttft,foo"),
                     ({"metric_percentiles": (0.0,)}, "--metric-percentiles"),
                     ({"base_url": "localhost:8000"}, "--base-url 'localhost:8000'")):
        with pytest.raises(ValueError, match=re.escape(name)):
            ServeBenchConfig(**kw)
    assert ServeBenchConfig(endpoint_type="openai-chat").endpoint_type == "chat"


def test_wav_layout_waits_for_the_data_chunk_and_skips_others() -> None:
    fmt = struct.pack("<HHIIHH", 1, 2, 22050, 22050 * 4, 4, 16)
    info = b"LIST" + struct.pack("<I", 5) + b"abcde" + b"\0"        # odd size: a pad byte
    head = (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + b"fmt "
            + struct.pack("<I", len(fmt)) + fmt + info + b"data" + struct.pack("<I", 0xFFFFFFFF))
    for cut in (0, 11, 20, len(head) - 1):
        assert wav_layout(head[:cut]) is None
    assert wav_layout(head) == (len(head), 22050, 4)


def test_percentile_is_numpys() -> None:
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for p in (1, 50, 90, 99, 99.9, 100):
        assert math.isclose(percentile(values, p), float(np.percentile(values, p)))

