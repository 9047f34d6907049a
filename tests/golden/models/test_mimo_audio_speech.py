"""MiMo-Audio end to end on the tiny fixtures: the LLM's forced-speech patches (golden against
upstream generate, test_mimo_audio.py) -> codes as upstream's MimoAudio.forward cuts them ->
the tokenizer decoder (golden against upstream decode, test_mimo_audio_tokenizer.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omnistage.models.mimo_audio.config import MiMoAudioConfig
from omnistage.models.mimo_audio.speech import codes_to_wave, patches_to_codes
from omnistage.models.mimo_audio.tokenizer_decoder import MiMoAudioTokenizerDecoder

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "mimo_audio"


@pytest.fixture(scope="module")
def fx() -> dict:
    return json.loads((FIXTURES / "tokens.json").read_text())


@pytest.fixture(scope="module")
def cfg(fx: dict) -> MiMoAudioConfig:
    return MiMoAudioConfig.from_folder(FIXTURES / "tiny", fx["args"]["empty_idx"])


def test_spoken_patches_become_codes_and_a_waveform(fx: dict, cfg: MiMoAudioConfig) -> None:
    a = fx["args"]
    codes = patches_to_codes(torch.tensor(fx["speak"]), cfg, a["sostm_idx"], a["eostm_idx"])
    assert codes.shape == (8, fx["steps"] * 4)
    assert codes[:, 0].tolist() == fx["speak"][1:9]          # frame 0's eight ids, in order
    wav = codes_to_wave(MiMoAudioTokenizerDecoder.from_pretrained(FIXTURES / "tokenizer"), codes)
    assert wav.shape == (codes.shape[1] * 2 * 2 * 4,)        # avg_pooler 2, stride 2, hop 4
    assert torch.isfinite(wav).all() and wav.std() > 0.01


def test_the_span_between_sostm_and_eostm_is_kept(fx: dict, cfg: MiMoAudioConfig) -> None:
    a = fx["args"]
    speak = torch.tensor(fx["speak"]).view(-1, 4, 9)
    text_patch = speak[:1].clone()
    text_patch[:, :, 0], text_patch[:, :, 1:] = a["sostm_idx"], torch.tensor(cfg.empty_ids)
    end = text_patch.clone()
    end[:, :, 0] = a["eostm_idx"]
    flat = torch.cat([speak[:1], text_patch, speak[1:3], end, speak[3:]]).flatten()
    codes = patches_to_codes(flat, cfg, a["sostm_idx"], a["eostm_idx"])
    assert codes.tolist() == speak[1:3, :, 1:].reshape(-1, 8).T.tolist()
