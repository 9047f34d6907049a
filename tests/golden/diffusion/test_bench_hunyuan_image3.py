"""The HunyuanImage-3.0 bench's CPU path (`python -m omnistage.benchmarks.hunyuan_image3 --tiny`):
the upstream code (in its own environment, /work/ref-hi3 or $OMNISTAGE_HI3_REF_PYTHON) and ours
generate the same image from the same random weights and seed, and the figures are reported.
Skipped where the reference's interpreter or checkout is missing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from omnistage.benchmarks import hunyuan_image3 as bench


def reference_ready() -> bool:
    python = bench.reference_python()
    if not Path(bench.UPSTREAM, "hunyuan_image_3").is_dir():
        return False
    probe = subprocess.run([python, "-c", "import transformers, diffusers, einops"],
                           capture_output=True, check=False)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not reference_ready(),
                                reason="no HunyuanImage-3.0 reference environment")


def test_tiny_bench_runs_and_agrees(tmp_path: Path) -> None:
    out = tmp_path / "hi3.json"
    result = bench.main(["--tiny", "--device", "cpu", "--steps", "3", "--images", "1",
                         "--out", str(out)])
    assert json.loads(out.read_text())["ratios"] == result["ratios"]
    assert result["ratios"]["hunyuan_image3_speedup_vs_reference"] > 0
    assert result["ratios"]["hunyuan_image3_step_speedup_vs_reference"] > 0
    assert result["shape"] == {"layers": 2, "size": [32, 32], "steps": 3}
    assert result["max_abs_diff"]["latents"] < 2e-4 and result["max_abs_diff"]["image"] <= 1
    for side in ("reference", "ours"):
        assert len(result[side]["image_s"]) == 2 and result[side]["per_step_s"] > 0
