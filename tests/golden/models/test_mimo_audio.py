"""MiMo-Audio's LLM + patch encoder + patch decoder on our Qwen2 layers, golden against upstream
XiaomiMiMo/MiMo-Audio's MiMoAudioForCausalLM.generate (commit in tokens.json), greedy, float32:
the tiny checkpoint and the tokens come from scripts/mimo_audio_fixtures.py, run with upstream's
own transformers (4.49); the checkpoint is loaded by our loader from its save_pretrained folder."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from omnistage.models.mimo_audio.config import MiMoAudioConfig
from omnistage.models.mimo_audio.model import MiMoAudioForCausalLM

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "mimo_audio"


@pytest.fixture(scope="module")
def fx() -> dict:
    return json.loads((FIXTURES / "tokens.json").read_text())


@pytest.fixture(scope="module")
def model(fx: dict) -> MiMoAudioForCausalLM:
    return MiMoAudioForCausalLM.from_pretrained(FIXTURES / "tiny", fx["args"]["empty_idx"])


def test_fixture_is_not_degenerate(fx: dict) -> None:
    assert fx["first_text_logits_std"] > 0.5
    speak = torch.tensor(fx["speak"]).view(fx["steps"], 4, 9)
    assert len(set(speak[:, :, 1:].flatten().tolist())) > 10   # the patches vary
    assert len(set(fx["free"][::36])) > 2                        # so does the text


@pytest.mark.parametrize("mode", ["free", "speak"])
def test_tokens_match_upstream_generate(fx: dict, model: MiMoAudioForCausalLM, mode: str) -> None:
    out = model.generate(torch.tensor(fx["prompt"]), fx["steps"], force_speech=mode == "speak")
    assert out.tolist() == fx[mode]


def test_a_wrong_delay_pattern_fails(fx: dict, model: MiMoAudioForCausalLM) -> None:
    good = model.cfg
    try:
        model.cfg = dataclasses.replace(good, delays=(0,) * good.audio_channels)
        out = model.generate(torch.tensor(fx["prompt"]), 2, force_speech=True)
    finally:
        model.cfg = good
    assert out.tolist() != fx["speak"][:len(out)]


def test_full_attention_patch_encoder_matches_upstream(fx: dict, tmp_path: Path) -> None:
    """The released configs' input_full_attention: true, same weights (config.json edited)."""
    d = json.loads((FIXTURES / "tiny" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**d, "input_full_attention": True}))
    shutil.copy(FIXTURES / "tiny" / "model.safetensors", tmp_path)
    model = MiMoAudioForCausalLM.from_pretrained(tmp_path, fx["args"]["empty_idx"])
    assert MiMoAudioConfig.from_folder(tmp_path, 299).input_full_attention
    out = model.generate(torch.tensor(fx["prompt"]), fx["steps"], force_speech=True)
    assert out.tolist() == fx["speak_full_attention"] != fx["speak"]
