"""OMNISTAGE_TRACE_DIR: every process of a pipeline (the caller's router, each stage process)
writes its spans, and `merge` joins them into one Chrome trace that shows a request's path
(which also shows what the stages were told: a finished request is freed, not aborted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from omnistage.utils import trace


def test_off_by_default() -> None:
    if "OMNISTAGE_TRACE_DIR" not in os.environ:
        assert not trace.enabled() and trace.save() is None
        trace.span("nothing", 0.0, 1.0)    # a no-op


def test_pipeline_trace(tiny_qwen3: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace"
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        from omnistage import Omni
        from omnistage.testing.toy_pipeline import toy_graph_yaml
        if __name__ == "__main__":
            with Omni(stage_config=toy_graph_yaml({str(tiny_qwen3)!r}, chunked=True,
                                                  max_tokens=5), device="cpu") as omni:
                omni.generate({{"prompt_token_ids": list(range(5, 20))}})
    """))
    subprocess.run([sys.executable, str(script)], check=True, timeout=120,
                   env={**os.environ, "OMNISTAGE_TRACE_DIR": str(out)})
    files = sorted(out.glob("trace-*.json"))
    assert len(files) == 4                            # the caller and three stage processes
    merged = tmp_path / "all.json"
    n = trace.merge(out, merged)
    events = json.loads(merged.read_text())["traceEvents"]
    assert n == len(events)
    threads = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert threads == {"router", "first", "second", "vectors"}
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] > 1e15 for e in spans)     # wall clock, microseconds
    names = {e["name"] for e in spans}
    assert {"AddRequest", "EdgeChunk", "step", "route", "ar.step"} <= names
    # a request done in every stage is freed there, not aborted
    freed = {e["tid"] for e in spans if e["name"] == "FreeRequest"}
    assert len(freed) == 3 and "AbortRequest" not in names
    # one request's path: added to the first stage before anything of it is routed onward
    rid = next(e["args"]["request"] for e in spans if e["name"] == "AddRequest")
    added = min(e["ts"] for e in spans if e["name"] == "AddRequest")
    routed = [e["ts"] for e in spans if e["name"] == "route" and e["args"]["request"] == rid]
    assert routed and min(routed) > added
