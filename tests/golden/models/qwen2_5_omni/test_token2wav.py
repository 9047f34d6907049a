"""Golden: Qwen2.5-Omni's token2wav as a generation-stage model (DiT integrated by RK4 one step
per call, then BigVGAN) vs transformers' `Qwen2_5OmniToken2WavModel` on the same codes,
speaker and noise seed, float32: the waveform within 1e-4 at audible amplitude."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.diffusion.solvers.rk4 import sway_times
from omnistage.generation.token2wav import Token2WavGenerator, Token2WavOptions

SEED = 7


def decode(generator: Token2WavGenerator, chunks: list[torch.Tensor], speaker: int
           ) -> tuple[torch.Tensor, int]:
    """Feed the chunks (the last closes the input), then step until the backlog is done."""
    state: dict = {}
    out: dict = {}
    calls = 0
    for i, codes in enumerate(chunks):
        last = i == len(chunks) - 1
        out = generator.generate([{"codes": codes, "speaker": torch.full_like(codes, speaker)}],
                                 [state], [last])[0]
        calls += 1
    while generator.has_backlog(state):
        assert calls < 100
        out = generator.generate([{}], [state], [True])[0]
        calls += 1
    return out["audio"], calls


def test_waveform_equals_transformers(omni25_path: Path, omni25_hf) -> None:
    generator = Token2WavGenerator.from_pretrained(omni25_path, "qwen2_5_omni_token2wav",
                                                   torch.device("cpu"), None,
                                                   Token2WavOptions(seed=SEED, chunk_blocks=0))
    # (chunk_blocks 0: whole, as the reference)
    codes = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(1))
    speaker = omni25_hf.speaker_map["Ethan"]
    torch.manual_seed(SEED)
    with torch.no_grad():
        expected = omni25_hf.token2wav(codes[None], conditioning=speaker["cond"].float(),
                                       reference_mel=speaker["ref_mel"].float()).reshape(-1)
    assert 0.1 < expected.abs().max() < 0.99, "audible, and not clamped flat"
    audio, calls = decode(generator, [codes[:5], codes[5:]], speaker=1)   # "ethan"
    assert calls == 9 + 1, "one RK4 step per call: 9 steps over the 10-point grid"
    assert audio.shape == expected.shape
    assert (audio - expected).abs().max() <= 1e-4
    other, _ = decode(generator, [codes], speaker=0)
    assert (other - expected).abs().max() > 1e-2, "the speaker's conditioning matters"


def test_sway_grid_matches_reference() -> None:
    t = torch.linspace(0, 1, 10)
    expected = t + -1.0 * (torch.cos(torch.pi / 2 * t) - 1 + t)
    torch.testing.assert_close(sway_times(10, -1.0, "cpu"), expected)
    with pytest.raises(ValueError, match="num_steps=1"):
        sway_times(1, -1.0, "cpu")
