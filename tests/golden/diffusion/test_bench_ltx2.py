"""The LTX-2 bench's CPU path (`python -m omnistage.benchmarks.ltx2 --tiny`): both transformers
run the same step on the same seeded weights, agree, and the headline figure is reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnistage.benchmarks import ltx2

pytest.importorskip("diffusers")


def test_tiny_bench_runs_and_agrees(tmp_path: Path) -> None:
    out = tmp_path / "ltx2.json"
    result = ltx2.main(["--tiny", "--no-compile", "--timed-steps", "1", "--device", "cpu",
                        "--out", str(out)])
    assert json.loads(out.read_text())["ratios"] == result["ratios"]
    assert result["ratios"]["ltx2_step_speedup_vs_diffusers"] > 0
    assert result["tokens"] == {"video": 8, "audio": 9, "text": 32}
    assert max(result["max_abs_diff"].values()) < 1e-4
    assert len(result["ours"]["eager_steps_s"]) == 2
