"""backend: ray with no address: `omnistage serve` starts a local Ray cluster of its own, and
every process it caused to exist ends with it, Ray's own included (issue 37.5).

Ray daemonizes some of them: ray::DashboardAgent and ray::RuntimeEnvAgent are the raylet's
children, lose it when it dies (to init) and rename themselves, so the test counts a server's
processes as its descendants while it runs plus every process that names its Ray session
folder (in its command line or an open log file). Measured before the fix: after a SIGKILL of
the server both agents were still alive 38 s later.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from omnistage.testing.processes import (
    command_line,
    descendants,
    free_port,
    naming,
    started,
    still_running,
)

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 240
GONE_TIMEOUT_S = 30
SESSION = re.compile(r"(/\S*?/session_\d[^/\s]*)")


def _wait_ready(server: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"not ready in {START_TIMEOUT_S} s: {log.read_text()[-3000:]}")


def _session_of(pids: set[int]) -> str:
    """The Ray session folder the raylet and GCS of these processes were started with."""
    for pid in pids:
        found = SESSION.search(command_line(pid))
        if found:
            return found.group(1)
    raise AssertionError(f"no Ray session among {[command_line(p)[:80] for p in pids]}")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill", "term"])
def test_a_server_with_its_own_cluster_leaves_no_process(tiny_qwen3: Path, tmp_path: Path,
                                                         sig: signal.Signals) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "omnistage.entrypoints.cli.main", "serve", str(tiny_qwen3),
             "--worker-backend", "ray", "--device", "cpu", "--port", str(port),
             "--log-level", "warning"], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    ours: dict[int, int] = {}
    try:
        _wait_ready(server, f"http://127.0.0.1:{port}", log)
        tree = descendants(server.pid)
        session = _session_of(tree)
        # the agents start with the raylet, before it takes the stage's actor: all here now
        for pid in tree | naming(session):
            ours[pid] = started(pid) or 0
        names = {command_line(p) for p in ours}
        assert {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names, names
        assert any(n.startswith("omnistage: stage") for n in names), names
        os.kill(server.pid, sig)
        server.wait(60)
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while still_running(ours) or naming(session):
            left = [command_line(p) or str(p) for p in set(still_running(ours)) | naming(session)]
            assert time.monotonic() < deadline, f"left {GONE_TIMEOUT_S} s after {sig!r}: {left}"
            time.sleep(0.2)
        print(f"\n{sig.name}: {len(ours)} processes, all gone "
              f"{time.monotonic() - deadline + GONE_TIMEOUT_S:.1f} s after the server")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        for pid in still_running(ours):      # a failed run leaves nothing for the next test
            os.kill(pid, signal.SIGKILL)
