"""What a new user meets first on the command line: help and argument errors before any heavy
import, one line per error, hints only where they help, vLLM's dtype names, and the same engine
flags on `generate` as on `serve`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


HEAVY = ("torch", "transformers", "numpy", "fastapi")


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"],
                                  ["serve", "--max-num-seq", "3"], ["serve", "--port", "x"],
                                  []])
def test_help_and_argument_errors_import_nothing_heavy(argv: list[str]) -> None:
    """In a fresh interpreter: the answer comes before torch or transformers are imported (the
    10-15 s they cost was the wait for `omnistage --help`)."""
    code = ("import sys\nfrom omnistage.entrypoints.cli.main import main\n"
            f"try:\n    rc = main({argv!r})\nexcept SystemExit as e:\n    rc = e.code\n"
            f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
            "print('RC', rc, 'HEAVY', heavy, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert "HEAVY []" in done.stderr, done.stderr[-2000:]
    assert done.stdout or done.stderr


def _without(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """This interpreter as if `modules` were not installed (as find_spec sees it)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in modules else real(name, *a))


def test_missing_diffusers_is_found_before_any_stage_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A diffusers pipeline with no native port runs on the generic adapter, which needs the
    diffusers extra: refused in the constructor, before a stage process spawns."""
    from omnistage.engine import async_omni

    (tmp_path / "model_index.json").write_text('{"_class_name": "KandinskyPipeline"}')
    _without(monkeypatch, "diffusers")
    monkeypatch.setattr(async_omni, "Orchestrator",
                        lambda *a, **k: pytest.fail("a stage started"))
    with pytest.raises(RuntimeError, match=r"this model needs omnistage's \[diffusers\] extra"):
        async_omni.AsyncOmni(str(tmp_path), device="cpu")


def test_async_with_async_omni_stops_its_stages(tiny_qwen3: Path) -> None:
    import asyncio

    from omnistage import AsyncOmni, SamplingParams

    async def go() -> tuple[str, AsyncOmni]:
        async with AsyncOmni(str(tiny_qwen3), device="cpu", max_model_len=64) as engine:
            text = ""
            async for out in engine.generate("Hi", SamplingParams(max_tokens=3)):
                text = out.text
            return text, engine

    text, engine = asyncio.run(go())
    assert text and engine.orchestrator._closed   # shut down on leaving the block


def test_progress_in_a_pipe_is_plain_lines(tmp_path: Path) -> None:
    """One prompt (a bar for one request too), stderr a pipe: plain lines, no tqdm frames."""
    done = subprocess.run([sys.executable, "-m", "omnistage.entrypoints.cli.main", "generate",
                           "--prompt", "a 3", "--steps", "30", "--num-images", "2",
                           "--output-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\r" not in done.stderr, done.stderr[-3000:]
    lines = [l for l in done.stderr.splitlines() if l.startswith("Processed prompts: ")]
    assert lines and lines[-1].startswith("Processed prompts: 1 in "), done.stderr[-3000:]
    assert len(list(tmp_path.glob("*.png"))) == 2
