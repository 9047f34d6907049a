"""The BAGEL bench's CPU paths (`python -m omnistage.benchmarks.bagel`): the upstream code (in
its own environment: /work/ref-bagel or $OMNISTAGE_BAGEL_REF_PYTHON with
$OMNISTAGE_BAGEL_REF_PYTHONPATH; its checkout $OMNISTAGE_BAGEL_UPSTREAM, else
/work/ref-bagel/Bagel) and ours draw the same image from the same random weights and seed, and
the figures are reported: the fixtures' tiny model, and the 7B's structure at a small width
(the GPU run's code path) in float32. Skipped where the reference's interpreter or checkout is
missing."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from omnistage.benchmarks import bagel as bench

UPSTREAM = os.environ.get("OMNISTAGE_BAGEL_UPSTREAM", str(bench.UPSTREAM))


def reference_ready() -> bool:
    if not Path(UPSTREAM, "inferencer.py").is_file():
        return False
    python, env = bench.reference_interpreter()
    probe = subprocess.run([python, "-c", "import transformers, einops"], env=env,
                           capture_output=True, check=False)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not reference_ready(), reason="no BAGEL reference environment")


def test_tiny_bench_runs_and_agrees(tmp_path: Path) -> None:
    out = tmp_path / "bagel.json"
    result = bench.main(["--tiny", "--device", "cpu", "--steps", "3", "--images", "1",
                         "--upstream", UPSTREAM, "--out", str(out)])
    assert json.loads(out.read_text())["ratios"] == result["ratios"]
    assert result["ratios"]["bagel_speedup_vs_reference"] > 0
    assert result["ratios"]["bagel_step_speedup_vs_reference"] > 0
    assert result["shape"] == {"model": "tiny", "size": [32, 32], "steps": 3}
    assert result["max_abs_diff"]["image"] <= 1
    assert result["max_abs_diff"]["latents"] <= 1e-5
    for side in ("reference", "ours"):
        assert len(result[side]["image_s"]) == 2 and result[side]["per_step_s"] > 0
        assert len(result[side]["step_s"][1]) >= 1


def test_small_width_of_the_7b_structure_agrees_in_float32() -> None:
    """The 7b run's path (configs written by the reference, real vocabulary, 28 / 4 heads, the
    VAE's four levels, the released grid sizes) at a small width: the same latents."""
    result = bench.main(["--shape", "small", "--float32", "--device", "cpu", "--steps", "2",
                         "--images", "1", "--upstream", UPSTREAM])
    assert result["shape"] == {"model": "small", "size": [256, 256], "steps": 2, "layers": 2}
    assert result["dtype"] == "float32"
    assert result["max_abs_diff"]["latents"] <= 1e-4
    assert result["max_abs_diff"]["image"] <= 1
    assert result["reference"]["num_parameters"] == result["ours"]["num_parameters"]
