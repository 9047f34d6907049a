"""Golden: our CosyVoice3 flow and vocoder (omnistage/models/cosyvoice3/, the loop in
diffusion/pipelines/cosyvoice3.py) against the upstream code's own outputs (FunAudioLLM/
CosyVoice at the commit in tests/fixtures/cosyvoice3/manifest.json, run in float32 by
scripts/cosyvoice3_fixtures.py) on the same tiny checkpoint, loaded by our loader from the
released folder layout (cosyvoice3.yaml, flow.pt, hift.pt): the mel of 10 guided Euler steps
and the waveform within 1e-4."""

from __future__ import annotations

import pytest
import torch

from omnistage.diffusion.pipelines.cosyvoice3 import CloneInput, fixed_noise, token2mel
from omnistage.models.cosyvoice3.hift import SourceNoise
from omnistage.models.cosyvoice3.model import CosyVoice3
from tests.helpers.cosyvoice3 import expected, manifest, write_checkpoint

CASES = ("a", "b")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return CosyVoice3.from_pretrained(write_checkpoint(tmp_path_factory.mktemp("cosyvoice3")))


@pytest.fixture(scope="module")
def ref():
    return manifest(), expected()


def _input(m: dict, exp: dict, case: str, streaming: bool | None = None) -> CloneInput:
    c = m["cases"][case]
    return CloneInput(tokens=exp[f"{case}.token"][0], prompt_tokens=exp[f"{case}.prompt_token"][0],
                      prompt_mel=exp[f"{case}.prompt_feat"][0], xvector=exp[f"{case}.embedding"][0],
                      streaming=c["streaming"] if streaming is None else streaming)


def _want_mel(exp: dict, case: str) -> torch.Tensor:
    return exp[f"{case}.mel"][0].T                                       # (T, mel)


def test_mel_of_a_batch_of_two_equals_upstream(model, ref):
    """Case a (full attention) and case b (streaming chunk mask, other lengths) in one batch."""
    m, exp = ref
    mels = token2mel(model.flow, [_input(m, exp, c) for c in CASES],
                     fixed_noise(model.cfg.flow.output_size), m["n_timesteps"])
    for case, mel in zip(CASES, mels):
        want = _want_mel(exp, case)
        assert want.abs().max() > 1.0, "the reference mel is near zero"
        assert mel.shape == want.shape, (case, mel.shape, want.shape)
        torch.testing.assert_close(mel, want, atol=1e-4, rtol=1e-4, msg=case)


def test_each_alone_equals_upstream(model, ref):
    m, exp = ref
    noise = fixed_noise(model.cfg.flow.output_size)
    for case in CASES:
        (mel,) = token2mel(model.flow, [_input(m, exp, case)], noise, m["n_timesteps"])
        torch.testing.assert_close(mel, _want_mel(exp, case), atol=1e-4, rtol=1e-4)


def test_the_comparison_sees_the_chunk_mask_and_the_step_count(model, ref):
    """A plausible bug (streaming ignored, one step short) moves the mel well past 1e-4."""
    m, exp = ref
    noise = fixed_noise(model.cfg.flow.output_size)
    (mel,) = token2mel(model.flow, [_input(m, exp, "b", streaming=False)], noise, m["n_timesteps"])
    assert (mel - _want_mel(exp, "b")).abs().max() > 1e-2
    (mel,) = token2mel(model.flow, [_input(m, exp, "a")], noise, m["n_timesteps"] - 1)
    assert (mel - _want_mel(exp, "a")).abs().max() > 1e-2


def _noise(exp: dict) -> SourceNoise:
    return SourceNoise(exp["noise.rand_ini"], exp["noise.sine_waves"], exp["noise.uv"])


@pytest.mark.parametrize("case", CASES)
def test_waveform_equals_upstream(model, ref, case):
    _, exp = ref
    wave, source = model.hift(exp[f"{case}.mel"], _noise(exp))
    want = exp[f"{case}.wave"]
    assert wave.shape == want.shape, (wave.shape, want.shape)
    assert want.abs().mean() > 0.05 and (want.abs() < 0.99).float().mean() > 0.8, \
        "the reference waveform is near zero or mostly clamped"
    torch.testing.assert_close(source, exp[f"{case}.source"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(wave, want, atol=1e-4, rtol=1e-4)


def test_the_waveform_comparison_sees_the_source(model, ref):
    """A source from an f0 5% off (a plausible bug: a wrong hop or sample rate in the sines)
    changes the waveform well past 1e-4. (Upstream's rand_ini only touches sample 0, which
    the frame-rate linear resampling never reads: it has no effect at all.)"""
    _, exp = ref
    mel = exp["a.mel"]
    f0 = model.hift.f0_predictor.double()(mel.double()).float()
    wave = model.hift.decode(mel, model.hift.source(f0 * 1.05, _noise(exp)))
    assert (wave - exp["a.wave"]).abs().max() > 1e-2
