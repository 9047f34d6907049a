"""Stage processes are `python -m omnistage.stages.entry`, not multiprocessing's spawn: a script
needs no `if __name__ == "__main__":` guard (the stages never import it), even one read from
stdin; they are named in ps, and none is left when the script ends."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omnistage.testing.processes import alive

# no guard: with spawn, each stage process ran this again and died starting an engine of its own
UNGUARDED = textwrap.dedent("""
    from omnistage import DiffusionParams, Omni

    with Omni(device="cpu") as omni:
        pids = omni.engine.orchestrator.stage_pids()
        for name, pid in pids.items():
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                print("title", name, f.read().split(b"\\0")[0].decode(), flush=True)
        print("pids", *pids.values(), flush=True)
        (out,) = omni.generate("a handwritten 3", DiffusionParams(num_images=2, seed=0,
                                                                   num_inference_steps=4))
    print("images", len(out.images), out.images[0].size)
""")


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_script_without_guard_runs_and_leaves_no_stage(tmp_path: Path, how: str) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    # the child must import this checkout's omnistage, as the parent does
    root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    args, stdin = ([sys.executable, str(script)], None) if how == "file" else (
        [sys.executable, "-"], script.read_text())
    proc = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "title dit omnistage: stage dit" in lines, proc.stdout
    assert "images 2 (64, 64)" in lines, proc.stdout
    pids = [int(p) for p in next(x for x in lines if x.startswith("pids ")).split()[1:]]
    assert pids and not [p for p in pids if alive(p)]
    assert "leaked" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
