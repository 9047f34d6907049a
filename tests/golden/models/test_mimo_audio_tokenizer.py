"""MiMo-Audio-Tokenizer's decoder (RVQ ids -> waveform) on our layers, golden against upstream
MiMoAudioTokenizer.decode (XiaomiMiMo/MiMo-Audio 691ce54, float32, flash-attn replaced by an
SDPA stand-in with its window semantics): tiny seeded checkpoint and waveform from
scripts/mimo_audio_tokenizer_fixtures.py, loaded by our loader from its save_pretrained folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from omnistage.models.mimo_audio.tokenizer_decoder import MiMoAudioTokenizerDecoder

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "mimo_audio"


@pytest.fixture(scope="module")
def fx() -> dict:
    return load_file(FIXTURES / "tokenizer_decode.safetensors")


@pytest.fixture(scope="module")
def decoder() -> MiMoAudioTokenizerDecoder:
    return MiMoAudioTokenizerDecoder.from_pretrained(FIXTURES / "tokenizer")


def test_waveform_matches_upstream_decode(fx: dict, decoder: MiMoAudioTokenizerDecoder) -> None:
    ref = fx["wav"].flatten()
    assert ref.std() > 0.05                      # not a near-silent reference
    out = decoder(fx["codes"])
    assert out.shape == ref.shape                # 7 ids -> 14 -> 28 mel frames -> 112 samples
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_a_wrong_attention_window_fails(fx: dict, decoder: MiMoAudioTokenizerDecoder) -> None:
    stack = decoder.stack
    left = stack.left
    try:
        stack.left = -1                          # unbounded instead of upstream's window
        out = decoder(fx["codes"])
    finally:
        stack.left = left
    assert (out - fx["wav"].flatten()).abs().max() > 1e-3
