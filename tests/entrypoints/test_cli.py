"""`omnistage generate` end to end, in process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnistage.entrypoints.cli.main import main


def test_generate_prints_answers(tiny_qwen3: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["generate", str(tiny_qwen3), "--prompt", "hello", "--prompt", "world",
               "--max-tokens", "4", "--device", "cpu", "--json"])
    assert rc == 0
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert [l["prompt"] for l in lines] == ["hello", "world"]
    assert all(1 <= len(l["token_ids"]) <= 4 for l in lines)


def test_generate_bad_input_is_a_clear_error(tiny_qwen3: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    rc = main(["generate", str(tiny_qwen3), "--prompt", "x", "--max-tokens", "0"])
    assert rc == 2
    assert "max_tokens" in capsys.readouterr().err
    rc = main(["generate", "/nonexistent/model", "--prompt", "x"])
    assert rc == 2
