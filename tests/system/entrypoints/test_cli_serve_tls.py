"""One real `omnistage serve` (the built-in demo model) started from a `--config` file with TLS
and the engine flags: it answers over HTTPS, and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from omnistage.testing.processes import free_port

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 180


def self_signed(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> httpx.Response:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            return httpx.get(url, verify=False, timeout=2)
        except httpx.HTTPError:
            time.sleep(0.3)
    raise TimeoutError(f"server not ready in {START_TIMEOUT_S} s:\n{log.read_text()}")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_serve_https_from_a_config_file(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    port = free_port()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"ssl_certfile: {cert}\nssl-keyfile: {key}\nport: 1\nmax-num-seqs: 2\n"
                   "uvicorn-log-level: warning\nserved-model-name: digits\ndevice: cpu\n")
    log = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "omnistage.entrypoints.cli.main", "serve",
                                 "--config", str(cfg), "--port", str(port)], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        health = wait_healthy(proc, f"https://127.0.0.1:{port}/health", log)
        assert health.status_code == 200
        models = httpx.get(f"https://127.0.0.1:{port}/v1/models", verify=False, timeout=10)
        assert [m["id"] for m in models.json()["data"]] == ["digits"]
        with pytest.raises(httpx.HTTPError):   # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(10)
    assert code == 0, log.read_text()
    assert "Application startup complete" not in log.read_text()   # uvicorn info: off
