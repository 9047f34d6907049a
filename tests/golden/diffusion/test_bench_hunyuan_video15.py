"""The HunyuanVideo-1.5 bench's CPU path (`python -m omnistage.benchmarks.hunyuan_video15
--tiny`): diffusers' two padded calls and our one compacted call of two rows give the same
guided velocity on the same seeded weights, and the headline figure is reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnistage.benchmarks import hunyuan_video15

pytest.importorskip("diffusers")


def test_tiny_bench_runs_and_agrees(tmp_path: Path) -> None:
    out = tmp_path / "hv15.json"
    result = hunyuan_video15.main(["--tiny", "--no-compile", "--timed-steps", "1", "--device",
                                   "cpu", "--out", str(out)])
    assert json.loads(out.read_text())["ratios"] == result["ratios"]
    assert result["ratios"]["hunyuan_video15_step_speedup_vs_diffusers"] > 0
    assert result["tokens"]["video"] == 3 * 3 * 5
    assert result["output_max_abs"] > 0.1
    assert result["max_abs_diff"] < 1e-4 * max(1.0, result["output_max_abs"])
    assert len(result["ours"]["eager_steps_s"]) == 2
