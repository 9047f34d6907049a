"""The reaper of a local Ray cluster (stages/ray_reaper.py) without Ray: a stand-in server
starts it as ray_actor.connect does, then stand-ins of the session's processes, and dies.

    fake server ── reaper (told the session folder, or not)
      ├─ <ray_dir>/gcs.py --session_dir=S ── sleep        (one of Ray's programs; a child)
      └─ ray::DashboardAgent (a session of its own, S/logs/agent.log open, ignores SIGTERM)
    bystander: a process that reads S/logs/agent.log too (a `tail -f`): not Ray's, left alone

tests/system/engine/test_ray_fate.py runs the real thing (a server and its cluster).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnistage.testing.processes import alive, descendants, naming

REPO = Path(__file__).resolve().parents[3]

SERVER = """
import json, os, subprocess, sys, time
from omnistage.stages import ray_actor
base, ray_dir, mode = sys.argv[1:4]
session = os.path.join(base, f"session_2026-01-02_03-04-05_678901_{os.getpid()}")
os.makedirs(os.path.join(session, "logs"))
reaper = ray_actor.start_reaper(ray_dir)
gcs = subprocess.Popen([sys.executable, os.path.join(ray_dir, "gcs.py"),
                        f"--session_dir={session}"])
agent = subprocess.Popen([sys.executable, "-c", AGENT, os.path.join(session, "logs", "agent.log")],
                         start_new_session=True)
if mode == "told":
    ray_actor.tell_reaper(reaper, session)
elif mode == "not ours":
    ray_actor.tell_reaper(reaper, None)
while not os.path.exists(os.path.join(session, "logs", "agent.log")):
    time.sleep(0.01)
time.sleep(0.3)                  # the agent renamed itself, the gcs started its child
print(json.dumps({"session": session, "reaper": reaper.pid, "gcs": gcs.pid,
                  "agent": agent.pid}), flush=True)
time.sleep(600)
"""

AGENT = """
import signal, sys, time
import setproctitle
signal.signal(signal.SIGTERM, signal.SIG_IGN)   # blocked in its report to the dead GCS
log = open(sys.argv[1], "a")
setproctitle.setproctitle("ray::DashboardAgent")
time.sleep(600)
"""

BYSTANDER = "import sys, time; f = open(sys.argv[1]); time.sleep(600)"

GCS = """
import subprocess, time
subprocess.Popen(["sleep", "600"])
time.sleep(600)
"""


def _wait(predicate, timeout_s: float, what: object) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.05)


@pytest.fixture
def fake_ray(tmp_path: Path) -> Path:
    ray_dir = tmp_path / "site-packages" / "ray"
    ray_dir.mkdir(parents=True)
    (ray_dir / "gcs.py").write_text(GCS)
    return ray_dir


def _start(tmp_path: Path, ray_dir: Path, mode: str) -> tuple[subprocess.Popen, dict]:
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER.replace("AGENT", repr(AGENT)), str(tmp_path / "tmp"),
         str(ray_dir), mode], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    line = server.stdout.readline()
    assert line, f"the fake server ended: {server.wait(10)}"
    placed = json.loads(line)
    _wait(lambda: descendants(placed["gcs"]), 10, "the gcs started no child")
    placed["sleep"] = descendants(placed["gcs"]).pop()
    return server, placed


@pytest.mark.parametrize("mode", ["told", "untold"])
def test_the_session_ends_with_its_server(tmp_path: Path, fake_ray: Path, mode: str) -> None:
    """Told the session folder, or not (the server died during ray.init): found by name."""
    server, placed = _start(tmp_path, fake_ray, mode)
    ray_parts = [placed[k] for k in ("gcs", "sleep", "agent", "reaper")]
    log = os.path.join(placed["session"], "logs", "agent.log")
    bystander = subprocess.Popen([sys.executable, "-c", BYSTANDER, log])
    try:
        _wait(lambda: bystander.pid in naming(log), 10, "the bystander did not open the log")
        assert all(alive(p) for p in ray_parts)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        # SIGTERM, then SIGKILL after GRACE_S for the agent that ignores it
        _wait(lambda: not [p for p in ray_parts if alive(p)], 15,
              lambda: [p for p in ray_parts if alive(p)])
        assert bystander.poll() is None
    finally:
        bystander.kill()
        for pid in ray_parts:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_cluster_it_did_not_start_is_left_alone(tmp_path: Path, fake_ray: Path) -> None:
    server, placed = _start(tmp_path, fake_ray, "not ours")
    try:
        _wait(lambda: not alive(placed["reaper"]), 10, "the reaper stayed")
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        time.sleep(1)
        assert alive(placed["agent"]) and alive(placed["gcs"])
    finally:
        for key in ("gcs", "sleep", "agent"):
            if alive(placed[key]):
                os.kill(placed[key], signal.SIGKILL)

