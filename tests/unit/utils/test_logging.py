"""Log set-up and progress: repeated library warnings pass once, uvicorn's lines carry a
timestamp, weight loading reports bytes (log lines every tenth or 5 s off a terminal)."""

from __future__ import annotations

import logging
import logging.config
import re
from pathlib import Path

import pytest
import torch
from tqdm import tqdm

from omnistage.models.loader import iter_safetensors, tensor_nbytes
from omnistage.utils.logging import OnceFilter, Progress, uvicorn_log_config

STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


def _record(name: str, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)


def test_once_filter_passes_each_library_message_once() -> None:
    once = OnceFilter()
    warn = "`generation_config` default values have been modified"
    passed = [once.filter(_record("transformers.generation.utils", warn)) for _ in range(3)]
    assert passed == [True, False, False]
    assert once.filter(_record("transformers.generation.utils", "another %s", "warning"))
    assert not once.filter(_record("transformers.generation.utils", "another %s", "warning"))
    # our own loggers and other libraries are never collapsed
    assert all(once.filter(_record("omnistage.requests", "request x")) for _ in range(3))


def test_once_filter_stops_remembering_at_its_bound() -> None:
    once = OnceFilter(max_seen=2)
    for i in range(4):
        assert once.filter(_record("diffusers.pipeline", f"message {i}"))
    assert once.filter(_record("diffusers.pipeline", "message 3"))  # not remembered: passes
    assert not once.filter(_record("diffusers.pipeline", "message 0"))
    assert len(once.seen) == 2


def test_uvicorn_access_lines_carry_a_timestamp(capsys: pytest.CaptureFixture) -> None:
    logging.config.dictConfig(uvicorn_log_config("info"))
    logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5555",
                                             "GET", "/health", "1.1", 200)
    logging.getLogger("uvicorn.error").info("Application startup complete.")
    out, err = capsys.readouterr()
    assert STAMP.match(out) and '127.0.0.1:5555 - "GET /health HTTP/1.1" 200' in out, out
    assert STAMP.match(err) and "uvicorn.error: Application startup complete." in err, err


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_logs_every_tenth_or_five_seconds(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="test.progress")
    clock = FakeClock()
    with Progress(10**9, "Loading w", logging.getLogger("test.progress"),
                  is_terminal=False, clock=clock) as progress:
        for _ in range(40):                 # 40 updates of 25 MB, 0.25 s apart: 10 s in all
            clock.now += 0.25
            progress.update(25 * 10**6)
    lines = [r.getMessage() for r in caplog.records]
    # a line per tenth (100 .. 900 MB), each at least a second after the one before: the
    # tenths at 1, 2, ... 9 s; none at 100 % but the closing one with the rate
    assert len(lines) == 10, lines
    assert lines[0] == "Loading w: 100MB / 1.00GB (10%)"
    assert lines[8].endswith("(90%)")
    assert lines[-1].startswith("Loading w: 1.00GB in 10.0 s, 100MB/s"), lines[-1]

    caplog.clear()
    with Progress(10**9, "Fast", logging.getLogger("test.progress"),
                  is_terminal=False, clock=clock) as progress:
        for _ in range(40):                 # the same count in 0.4 s: the closing line only
            clock.now += 0.01
            progress.update(25 * 10**6)
    assert [r.getMessage()[:13] for r in caplog.records] == ["Fast: 1.00GB "]

    caplog.clear()
    slow = Progress(1000, "Slow", logging.getLogger("test.progress"), is_terminal=False,
                    clock=clock)
    for _ in range(3):                      # 1 % per 6 s: lines come from the clock alone
        clock.now += 6.0
        slow.update(10)
    slow.close(failed=True)                 # a failed load claims no total
    assert [r.getMessage() for r in caplog.records] == [
        "Slow: 10.0B / 1.00kB (1%)", "Slow: 20.0B / 1.00kB (2%)", "Slow: 30.0B / 1.00kB (3%)"]


def test_weight_loading_counts_bytes(tiny_qwen3: Path, caplog: pytest.LogCaptureFixture
                                     ) -> None:
    caplog.set_level(logging.INFO, logger="omnistage.models.loader")
    sizes = tensor_nbytes(tiny_qwen3 / "model.safetensors")
    tensors = dict(iter_safetensors(tiny_qwen3))
    assert sizes == {name: t.numel() * t.element_size() for name, t in tensors.items()}
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    lines = [r.getMessage() for r in caplog.records if r.name == "omnistage.models.loader"]
    total = sum(sizes.values())
    assert len(lines) >= 1 and lines[0].startswith(f"Loading {tiny_qwen3.name}: "), lines
    size = tqdm.format_sizeof(total, "B")
    assert lines[-1].startswith(f"Loading {tiny_qwen3.name}: {size} in "), lines[-1]


def test_transformers_mrope_warning_is_dropped_and_others_kept() -> None:
    """transformers calls the multimodal rotary keys of Qwen-Omni configs unrecognized (a
    line per config in every process); that one warning goes, any other stays."""
    from omnistage.utils.logging import quiet_known_noise

    quiet_known_noise()
    quiet_known_noise()                       # idempotent: one filter
    rope = logging.getLogger("transformers.modeling_rope_utils")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    rope.addHandler(handler)
    try:
        rope.warning("Unrecognized keys in `rope_parameters` for 'rope_type'='default': "
                     "{'interleaved', 'mrope_section'}")
        rope.warning("Unrecognized keys in `rope_parameters` for 'rope_type'='default': "
                     "{'mrope_section', 'bogus_factor'}")
        rope.warning("`rope_parameters`'s factor field must be a float or int >= 1, got 0")
    finally:
        rope.removeHandler(handler)
    assert len(seen) == 2 and "bogus_factor" in seen[0] and "factor field" in seen[1], seen
    assert sum(type(f).__name__ == "KnownNoiseFilter" for f in rope.filters) == 1
