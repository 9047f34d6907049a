"""The VibeVoice bench's --tiny path (CPU): both sides make the same frames, our audio equals
transformers' for the same request, and the headline fields are there."""

from __future__ import annotations

from omnistage.benchmarks.vibevoice import VibeVoiceBenchConfig, run


def test_tiny_bench_runs_and_matches_the_reference() -> None:
    result = run(VibeVoiceBenchConfig(tiny=True, frames=4, concurrency=(1, 8),
                                      reference_requests=1, num_diffusion_steps=3,
                                      device="cpu"))
    ratios = result["ratios"]
    for key in ("vibevoice_rtf_c1", "vibevoice_first_audio_s_c1",
                "vibevoice_first_audio_c8_over_c1", "vibevoice_e2e_speedup_vs_reference"):
        assert ratios[key] is not None and ratios[key] > 0, key
    ours, ref = result["omnistage"], result["reference"]
    assert ours["8"]["audio_s"] == ours["1"]["audio_s"] == [4 * 6 / 24000]
    assert ref["audio_samples"] == [24]
    assert result["max_abs_audio_diff_request0"] < 1e-4
