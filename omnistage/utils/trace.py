"""A timeline of what every process did, for finding where a request waited.

Set `OMNISTAGE_TRACE_DIR` and each process (the orchestrator's and every stage's) records spans
of its busy loops (messages handled, steps run, outputs routed) with wall-clock times, and
writes them as Chrome trace events to `<dir>/trace-<pid>.json` when it ends. `merge` joins a
directory's files into one, which chrome://tracing and https://ui.perfetto.dev open:

    OMNISTAGE_TRACE_DIR=/tmp/tr omnistage generate ...
    python -m omnistage.utils.trace /tmp/tr /tmp/tr/trace.json

Off (the variable unset), `span` is one attribute test. Threads are named after the stage they
serve, so the inproc backend's stages (threads of one process) show apart too.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path

_DIR = os.environ.get("OMNISTAGE_TRACE_DIR") or None
_events: list[dict] = []
_lock = threading.Lock()


def enabled() -> bool:
    return _DIR is not None


def name_thread(name: str) -> None:
    """Label the calling thread (a stage, the router) on the timeline."""
    if _DIR is not None:
        _events.append({"ph": "M", "name": "thread_name", "pid": os.getpid(),
                        "tid": threading.get_ident(), "args": {"name": name}})


def span(name: str, start: float, end: float | None = None, **args: object) -> None:
    """Record `name` from `start` to `end` (time.time() seconds; end: now), with `args`."""
    if _DIR is None:
        return
    end = time.time() if end is None else end
    _events.append({"ph": "X", "name": name, "pid": os.getpid(), "tid": threading.get_ident(),
                    "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6, "args": args})


def save() -> Path | None:
    """Write this process's events so far (again, whole, on each call); the file's path."""
    if _DIR is None:
        return None
    with _lock:
        path = Path(_DIR) / f"trace-{os.getpid()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"traceEvents": list(_events)}))
        tmp.replace(path)
        return path


def merge(directory: str | Path, out: str | Path) -> int:
    """Join every `trace-*.json` of `directory` into `out`; the number of events."""
    events: list[dict] = []
    for path in sorted(Path(directory).glob("trace-*.json")):
        events.extend(json.loads(path.read_text())["traceEvents"])
    Path(out).write_text(json.dumps({"traceEvents": events}))
    return len(events)


if _DIR is not None:
    atexit.register(save)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m omnistage.utils.trace TRACE_DIR OUT.json")
    print(f"{merge(sys.argv[1], sys.argv[2])} events -> {sys.argv[2]}")
