"""`omnistage serve` start-up mistakes, run as the user runs them (a subprocess, with a
deadline): one line on stderr, exit code != 0, no traceback, and nothing loaded first."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[3]


def serve_error(*args: str, cwd: Path = REPO) -> str:
    """Run `omnistage serve ARGS`; assert it fails with one line and no traceback; the line."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "omnistage.entrypoints.cli.main", "serve",
                           "--device", "cpu", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("omnistage serve: error: ")
    return lines[0]


def test_port_in_use_is_refused_before_the_model_loads(tiny_qwen3: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = serve_error(str(tiny_qwen3), "--port", str(port), "--log-level", "info")
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in line


def test_missing_paths_and_folders_without_weights(tiny_qwen3: Path, tmp_path: Path) -> None:
    line = serve_error("./no-such-model", cwd=tmp_path)
    assert "'./no-such-model': no such file or folder" in line
    assert "download" not in line            # a local path is never something to download
    assert "no such file or folder" in serve_error("~/no-such-model-omnistage")
    empty = tmp_path / "no-weights"
    empty.mkdir()
    shutil.copy(tiny_qwen3 / "config.json", empty / "config.json")
    line = serve_error(str(empty))
    assert f"folder {empty} has config.json but no weights" in line


def test_yaml_syntax_errors_name_file_and_line(tiny_qwen3: Path, tmp_path: Path) -> None:
    graph = tmp_path / "graph.yaml"
    graph.write_text("stages:\n  - name: llm\n    kind: [ar\n")
    line = serve_error(str(tiny_qwen3), "--stage-config", str(graph))
    assert f"{graph}: line 4" in line
    flags = tmp_path / "flags.yaml"
    flags.write_text("port: 8000\nhost: {a\n")
    assert f"{flags}: line 3" in serve_error("--config", str(flags))
