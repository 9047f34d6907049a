"""The regression guard (omnistage/benchmarks/regress.py): figures judged against a GPU's
committed baseline in the right direction, a drop past the tolerance named, a new figure
reported, the baseline refreshed only on purpose. Probes are stand-ins here (the real ones
need a GPU: benchmarks/device_session.sh runs them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnistage.benchmarks import regress
from omnistage.benchmarks.regress import HIGHER, LOWER, Baseline, baseline_path, judge


def test_the_baseline_file_is_named_by_gpu_model() -> None:
    folder = Path("b")
    assert baseline_path("NVIDIA H200", folder) == folder / "nvidia-h200.json"
    assert baseline_path("NVIDIA H100 80GB HBM3", folder) == folder / "nvidia-h100.json"
    assert baseline_path("NVIDIA H100 PCIe", folder) == folder / "nvidia-h100.json"
    assert baseline_path("cpu tiny", folder) == folder / "cpu-tiny.json"


def test_judged_in_each_figures_direction() -> None:
    base = Baseline("g", {"rtf": {"value": 1.0, "better": LOWER},
                          "tok_s": {"value": 100.0, "better": HIGHER}})
    ok = judge({"rtf": (1.04, LOWER), "tok_s": (96.0, HIGHER)}, base)
    assert [v.regressed for v in ok] == [False, False]
    bad = {v.figure: v for v in judge({"rtf": (1.06, LOWER), "tok_s": (94.0, HIGHER)}, base)}
    assert bad["rtf"].regressed and bad["tok_s"].regressed
    assert bad["rtf"].change == pytest.approx(0.06) and "REGRESSED" in bad["rtf"].line()
    better = judge({"rtf": (0.5, LOWER), "tok_s": (200.0, HIGHER)}, base)
    assert [v.regressed for v in better] == [False, False]
    assert better[0].change < 0                       # faster: a negative "worse"
    assert judge({"rtf": (1.06, LOWER)}, base, tolerance=0.1)[0].regressed is False
    (new,) = judge({"other": (3.0, LOWER)}, base)
    assert new.baseline is None and not new.regressed and "no baseline" in new.line()


def test_repeats_keep_the_best_and_report_the_spread() -> None:
    runs = [{"rtf": (1.0, LOWER), "tok_s": (90.0, HIGHER)},
            {"rtf": (1.1, LOWER), "tok_s": (100.0, HIGHER)}]
    assert regress.best_of(runs) == {"rtf": (1.0, LOWER), "tok_s": (100.0, HIGHER)}
    spread = regress.noise(runs)
    assert spread["rtf"] == pytest.approx(0.1) and spread["tok_s"] == pytest.approx(10 / 90)


def test_run_updates_on_purpose_and_fails_a_drop(tmp_path: Path) -> None:
    value = {"x": 1.0}
    fake = {"speech": lambda device, tiny: {"rtf_c8": (value["x"], LOWER)},
            "ar": lambda device, tiny: {"tok_s": (100.0, HIGHER)}}
    first = regress.run(("speech",), "cpu", "NVIDIA H200", folder=tmp_path, registry=fake)
    assert not first["baseline_found"] and first["regressed"] == []
    assert not (tmp_path / "nvidia-h200.json").exists()       # never written unasked
    regress.run(("speech", "ar"), "cpu", "NVIDIA H200", folder=tmp_path, registry=fake,
                update=True)
    saved = json.loads((tmp_path / "nvidia-h200.json").read_text())
    assert saved["figures"]["rtf_c8"] == {"value": 1.0, "better": LOWER}
    assert saved["tolerance"] == 0.05 and saved["gpu"] == "NVIDIA H200"
    value["x"] = 1.2                                          # 20% slower
    second = regress.run(("speech",), "cpu", "NVIDIA H200", folder=tmp_path, registry=fake)
    assert second["regressed"] == ["rtf_c8"]
    assert any("rtf_c8" in line and "REGRESSED" in line for line in second["verdicts"])
    # a refresh keeps the figures of probes not rerun, and a figure's own tolerance
    saved["figures"]["rtf_c8"]["tolerance"] = 0.3
    (tmp_path / "nvidia-h200.json").write_text(json.dumps(saved))
    regress.run(("speech",), "cpu", "NVIDIA H200", folder=tmp_path, registry=fake, update=True)
    saved = json.loads((tmp_path / "nvidia-h200.json").read_text())
    assert saved["figures"]["rtf_c8"] == {"value": 1.2, "better": LOWER, "tolerance": 0.3}
    assert "tok_s" in saved["figures"]
    regress.run(("speech",), "cpu", "NVIDIA H200", folder=tmp_path, registry=fake, update=True,
                repeats=2)                                   # measured again: the new noise
    assert json.loads((tmp_path / "nvidia-h200.json").read_text())["figures"]["rtf_c8"][
        "noise"] == 0.0
    with pytest.raises(ValueError, match="unknown probe 'nope'"):
        regress.run(("nope",), "cpu", "g", folder=tmp_path, registry=fake)


def test_the_shipped_probes_name_the_issue_figures() -> None:
    """The figures issue 41 names come from the shipped probes (their docstrings, here: the
    speech rows' names are built by one helper)."""
    rows = {"1": {"first_audio_s": {"median": 0.2}, "rtf": {"median": 0.3}},
            "8": {"first_audio_s": {"median": 0.3}, "rtf": {"median": 0.5}}}
    names = regress._speech_figures(rows, "omni25_")
    assert names["omni25_first_audio_c8_over_c1"] == (pytest.approx(1.5), LOWER)
    assert {"omni25_rtf_c1", "omni25_rtf_c8", "omni25_first_audio_s_c8"} <= set(names)
    assert set(regress.PROBES) == {"ar", "omni", "omni25", "tts", "duplex", "agent", "speech"}


def test_the_committed_baselines_are_well_formed() -> None:
    """Every committed baseline names its GPU (and its file is that GPU's), and each figure
    has a value, a direction and a tolerance the guard can use."""
    folder = Path(__file__).parents[2] / "benchmarks" / "results" / "baselines"
    files = sorted(folder.glob("*.json"))
    assert files
    for path in files:
        base = Baseline.load(path)
        assert base is not None and baseline_path(base.gpu, folder) == path
        for name, fig in base.figures.items():
            assert fig["better"] in (LOWER, HIGHER) and float(fig["value"]) > 0, name
            assert 0 < float(fig.get("tolerance", base.tolerance)) < 1, name
