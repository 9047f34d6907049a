"""The BAGEL bench's CPU path (`python -m omnistage.benchmarks.bagel --tiny`): the upstream code
(in its own environment, /work/ref-bagel or $OMNISTAGE_BAGEL_REF_PYTHON) and ours draw the same
image from the same random weights and seed, and the figures are reported. Skipped where the
reference's interpreter or checkout is missing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from omnistage.benchmarks import bagel as bench


def reference_ready() -> bool:
    if not Path(bench.UPSTREAM, "inferencer.py").is_file():
        return False
    probe = subprocess.run([bench.reference_python(), "-c", "import transformers, einops"],
                           capture_output=True, check=False)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not reference_ready(), reason="no BAGEL reference environment")


def test_tiny_bench_runs_and_agrees(tmp_path: Path) -> None:
    out = tmp_path / "bagel.json"
    result = bench.main(["--tiny", "--device", "cpu", "--steps", "3", "--images", "1",
                         "--out", str(out)])
    assert json.loads(out.read_text())["ratios"] == result["ratios"]
    assert result["ratios"]["bagel_speedup_vs_reference"] > 0
    assert result["ratios"]["bagel_step_speedup_vs_reference"] > 0
    assert result["shape"] == {"model": "tiny", "size": [32, 32], "steps": 3}
    assert result["max_abs_diff"]["image"] <= 1
    for side in ("reference", "ours"):
        assert len(result[side]["image_s"]) == 2 and result[side]["per_step_s"] > 0
        assert len(result[side]["step_s"][1]) >= 1
