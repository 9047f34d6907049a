"""`omnistage bench duplex` on the tiny Moshi on the CPU: the duplex runtime really ticks N
sessions fed in real time, the JSON has every figure, and the headline rule (the largest N
with p99 <= 80 ms and no missed tick) holds, checked on given latencies, not on timing."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from omnistage.benchmarks import duplex
from omnistage.benchmarks.duplex import MOSHI_7B, TICK_LIMIT_MS, headline, percentile
from omnistage.entrypoints.cli.main import main
from omnistage.stages.moshi_duplex import MoshiDuplex


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_duplex_tiny(tmp_path: Path) -> None:
    rc = main(["bench", "duplex", "--tiny", "--device", "cpu", "--out-dir", str(tmp_path),
               "--name", "duplex", "--sessions", "1,3", "--ticks", "6", "--warmup-ticks", "2"])
    assert rc == 0
    doc = json.loads((tmp_path / "duplex.json").read_text())      # strict JSON
    assert doc["benchmark"] == "duplex" and doc["device"] == "cpu" and doc["gpu"] is None
    assert doc["torch"] == torch.__version__ and doc["dtype"] == "float32"
    assert doc["model"]["frame_size"] == 1920 and doc["model"]["sample_rate"] == 24000
    assert doc["tick_ms"] == 80.0 and doc["tick_limit_ms"] == TICK_LIMIT_MS
    assert doc["config"]["sessions"] == [1, 3] and doc["config"]["warmup_ticks"] == 2
    assert set(doc["by_sessions"]) == {"1", "3"} and doc["complete"] is True
    for key, r in doc["by_sessions"].items():
        n = int(key)
        assert r["sessions"] == n and r["ticks"] == 6 and r["warmup_ticks"] == 2
        t = r["tick_ms"]
        assert all(positive(t[q]) for q in ("p50", "p90", "p99", "max", "mean"))
        assert t["p50"] <= t["p90"] <= t["p99"] <= t["max"]
        # every measured tick heard one frame and spoke one frame, for every session
        assert r["heard_frames"] == n * 6 and r["audio_frames_out"] == n * 6
        assert 0 <= r["missed_ticks_per_session"] <= r["missed_ticks_per_session_max"] <= 6
        assert 0 <= r["missed_inputs"] <= n * 6 and 0 <= r["warmup_missed_ticks"] <= 2
        assert math.isclose(r["rtf"], t["mean"] / 80.0, rel_tol=1e-9)
        assert positive(r["wall_over_audio"])
    ratios = doc["ratios"]
    assert ratios == headline(doc["by_sessions"])
    assert ratios["duplex_tick_p99_ms_c1"] == doc["by_sessions"]["1"]["tick_ms"]["p99"]
    assert {"duplex_sessions_per_gpu", "duplex_tick_p99_ms", "duplex_tick_p99_ms_c3",
            "duplex_missed_ticks_per_session_c3"} <= set(ratios)
    assert "warm" in doc["notes"]


def _rows(p99s: dict[int, float], missed: dict[int, int] | None = None) -> dict[str, dict]:
    missed = missed or {}
    return {str(n): {"sessions": n, "tick_ms": {"p99": p},
                     "missed_ticks_per_session": missed.get(n, 0) / 2,
                     "missed_ticks_per_session_max": missed.get(n, 0)}
            for n, p in p99s.items()}


def test_headline_rule() -> None:
    ratios = headline(_rows({1: 12.0, 4: 30.0, 8: 55.0, 16: 80.0, 24: 80.5, 32: 140.0}))
    assert ratios["duplex_sessions_per_gpu"] == 16          # 80.0 is within, 80.5 is not
    assert ratios["duplex_tick_p99_ms"] == 80.0 and ratios["duplex_tick_p99_ms_c1"] == 12.0
    assert ratios["duplex_tick_p99_ms_c32"] == 140.0
    # a missed tick disqualifies an N whatever its p99
    ratios = headline(_rows({1: 12.0, 8: 55.0, 16: 70.0}, missed={16: 1}))
    assert ratios["duplex_sessions_per_gpu"] == 8 and ratios["duplex_tick_p99_ms"] == 55.0
    assert ratios["duplex_missed_ticks_per_session_c16"] == 0.5
    # as stated: the largest N that passes, even past one that did not
    assert headline(_rows({1: 12.0, 8: 90.0, 16: 79.0}))["duplex_sessions_per_gpu"] == 16
    # the rows' order does not matter
    assert headline(dict(reversed(_rows({1: 5.0, 4: 9.0}).items())))[
        "duplex_sessions_per_gpu"] == 4
    none = headline(_rows({4: 81.0, 8: 99.0}))
    assert none["duplex_sessions_per_gpu"] == 0 and none["duplex_tick_p99_ms"] is None
    assert none["duplex_tick_p99_ms_c1"] is None                 # no N = 1 measured
    assert headline(_rows({1: 30.0}), limit_ms=20.0)["duplex_sessions_per_gpu"] == 0


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]                # 1 .. 100, unordered
    assert percentile(values, 0.5) == 50.0 and percentile(values, 0.9) == 90.0
    assert percentile(values, 0.99) == 99.0 and percentile(values, 1.0) == 100.0
    assert percentile([7.0], 0.99) == 7.0


@pytest.mark.parametrize("flags, message", [
    (["--sessions", "0"], "sessions=(0,)"),
    (["--sessions", "2,2"], "each N once"),
    (["--ticks", "1"], "ticks=1"),
    (["--warmup-ticks", "0"], "warmup_ticks=0"),
    (["--ticks", "126", "--warmup-ticks", "2"], "127 frames of context"),
])
def test_bench_duplex_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture,
                                    flags: list[str], message: str) -> None:
    rc = main(["bench", "duplex", "--tiny", "--device", "cpu", "--out-dir", str(tmp_path),
               *flags])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_7b_shape_is_the_released_config() -> None:
    """MOSHI_7B is transformers' MoshiConfig defaults (kyutai/moshiko's config), spelled out."""
    from transformers import MoshiConfig

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    ours, released = flat(MoshiConfig(**MOSHI_7B).to_dict()), flat(MoshiConfig().to_dict())
    differ = {k for k in ours.keys() | released.keys() if ours.get(k) != released.get(k)}
    assert differ <= {"audio_vocab_size"}          # None there, the codebook size (2048) here
    assert ours["audio_vocab_size"] == ours["audio_encoder_config.codebook_size"] == 2048


def test_the_7b_build_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The full-size path (transformers' classes from MOSHI_7B, saved, read by MoshiDuplex) at
    a scaled-down width and depth: every other field as the release's."""
    small = copy.deepcopy(duplex.MOSHI_7B)
    small.update(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=16, ffn_dim=128)
    small["depth_decoder_config"].update(hidden_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2,
                                         ffn_dim=64)
    small["audio_encoder_config"].update(hidden_size=32, num_hidden_layers=1, num_filters=4,
                                         upsample_groups=32, intermediate_size=64,
                                         codebook_dim=16,
                                         vector_quantization_hidden_dimension=16)
    monkeypatch.setattr(duplex, "MOSHI_7B", small)
    path = duplex.build_checkpoint("7b", tmp_path / "moshi", torch.device("cpu"),
                                   torch.float32, seed=0)
    model = MoshiDuplex(path, max_sessions=2)
    assert (model.cfg.num_codebooks, model.cfg.audio_vocab_size) == (8, 2048)
    assert (model.frame_size, model.sample_rate) == (1920, 24000)
    assert model.max_frames == duplex.CONTEXT_FRAMES["7b"]
    assert (model.cfg.depth.num_codebooks, model.cfg.vocab_size) == (8, 32000)
