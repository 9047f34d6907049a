"""Golden: CosyVoice3's front-end features (models/cosyvoice3/features.py) against upstream's
own feature calls (whisper.log_mel_spectrogram(n_mels=128) and torchaudio's kaldi.fbank(80,
dither 0) minus its mean, as cosyvoice/cli/frontend.py @ace7c47 calls them) on a 2.7 s clip,
the fixture made by scripts/cosyvoice3_frontend_fixture.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.models.cosyvoice3.features import speaker_features, whisper_log_mel

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "cosyvoice3" / "frontend.pt"


@pytest.fixture(scope="module")
def ref():
    d = torch.load(FIXTURE)
    return d["pcm16k"].float() / 32768.0, d


def test_whisper_log_mel_matches_upstream(ref):
    wav, d = ref
    want = d["log_mel"][0]
    assert want.shape == (128, 270) and want.std() > 0.2
    got = whisper_log_mel(wav)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_speaker_fbank_matches_upstream(ref):
    wav, d = ref
    want = d["fbank"]
    assert want.shape == (268, 80) and want.abs().mean() > 0.5
    got = speaker_features(wav)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_a_wrong_window_fails(ref):
    wav, d = ref
    bad = whisper_log_mel(wav * 0.5)                                     # a missing scale
    assert (bad - d["log_mel"][0]).abs().max() > 1e-2
