"""MiMo-Audio's speech input on our layers, golden against upstream (XiaomiMiMo/MiMo-Audio
691ce54, float32; fixtures from scripts/mimo_audio_encoder_fixtures.py): the log-mel of a
waveform, its audio ids (`MimoAudio.preprocess_input`: the tokenizer's encoder and residual VQ,
6000-frame segments batched, whole patches), and the prompt of a question about it
(`get_audio_understanding_sft_prompt`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from omnistage.models.mimo_audio.tokenizer_encoder import MiMoAudioTokenizerEncoder

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "mimo_audio"
CHANNELS, GROUP = 8, 4


@pytest.fixture(scope="module")
def fx() -> dict:
    return load_file(FIXTURES / "encode.safetensors")


@pytest.fixture(scope="module")
def encoder() -> MiMoAudioTokenizerEncoder:
    return MiMoAudioTokenizerEncoder.from_pretrained(FIXTURES / "tokenizer")


def test_log_mel_matches_upstream(fx: dict, encoder: MiMoAudioTokenizerEncoder) -> None:
    ref = fx["mel_short"]
    assert ref.std() > 0.5                        # not flat
    torch.testing.assert_close(encoder.log_mel(fx["wav_short"]), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["short", "long"])
def test_speech_ids_match_upstream(fx: dict, encoder: MiMoAudioTokenizerEncoder,
                                   name: str) -> None:
    """Short: 85 mel frames, 43 rows pooled to 22 ids, padded to 24 (whole patches). Long:
    6253 frames, two segments in one padded batch (the short segment's odd last pooled group
    as upstream fills it: its last row repeated)."""
    ref = fx[f"ids_{name}"].view(-1, CHANNELS)
    assert ref.unique(dim=0).shape[0] > 5         # codes vary: a broken encoder would show
    ids = encoder.speech_ids(fx[f"wav_{name}"], CHANNELS, GROUP)
    assert ids.shape == ref.shape
    assert torch.equal(ids, ref), (ids != ref).nonzero()[:5]


def test_segments_are_encoded_apart(fx: dict, encoder: MiMoAudioTokenizerEncoder,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A plausible bug fails: the two segments through the transformer as one sequence
    (attending across the cut, rotary positions running on) change the ids."""
    def as_one(rows: list) -> list:
        return list(encoder.stack.run(torch.cat(rows)).split([r.shape[0] for r in rows]))
    monkeypatch.setattr(encoder, "transform", as_one)
    ids = encoder.speech_ids(fx["wav_long"], CHANNELS, GROUP)
    ref = fx["ids_long"].view(-1, CHANNELS)
    assert ids.shape == ref.shape and not torch.equal(ids, ref)
