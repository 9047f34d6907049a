"""A real server whose stage process is killed: /health turns 503, requests get 503 (not 500,
not a hang), and the server still shuts down cleanly."""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            kids.append(int(entry))
    return kids


def _stage_pid(server_pid: int) -> int:
    for pid in _children(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()   # its title (stages/entry.py), or its command line
            if cmdline.startswith(b"omnistage: stage ") or b"omnistage.stages.entry" in cmdline:
                return pid
    raise AssertionError(f"no stage process under {server_pid}")


def test_a_dead_stage_turns_health_and_requests_to_503(start_server: Callable[..., Server]
                                                       ) -> None:
    server = start_server([])
    body = {"prompt": "a 4", "num_inference_steps": 2}
    assert server.post("/v1/images/generations", json=body).status_code == 200
    os.kill(_stage_pid(server.proc.pid), signal.SIGKILL)
    deadline = time.monotonic() + 20
    while server.get("/health").status_code != 503:
        assert time.monotonic() < deadline, "health still 200 after the stage died"
        time.sleep(0.1)
    error = server.get("/health").json()["error"]
    assert "dit" in error["message"] and error["code"] == "engine_dead"
    r = server.post("/v1/images/generations", json=body)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    metrics = server.get("/metrics")
    assert metrics.status_code == 200 and "omnistage_engine_healthy 0.0" in metrics.text
    assert server.stop() == 0
