"""MiMo-Audio's speech input on our layers, golden against upstream (XiaomiMiMo/MiMo-Audio
691ce54, float32; fixtures from scripts/mimo_audio_encoder_fixtures.py): the log-mel of a
waveform, its audio ids (`MimoAudio.preprocess_input`: the tokenizer's encoder and residual VQ,
6000-frame segments batched, whole patches), and the prompt of a question about it
(`get_audio_understanding_sft_prompt`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from omnistage.models.mimo_audio.config import MiMoAudioConfig
from omnistage.models.mimo_audio.prompt import (TEXT_START, MiMoAudioInputProcessor, SpecialIds,
                                                segment_ids, speech_patches, text_patches)
from omnistage.models.mimo_audio.tokenizer_encoder import MiMoAudioTokenizerEncoder
from tests.helpers.mimo_audio import build_tiny_text_tokenizer

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


def test_prompt_with_audio_equals_upstream(fx: dict, encoder: MiMoAudioTokenizerEncoder,
                                           tmp_path: Path) -> None:
    """A user turn of an audio part and a question, answered in text: the front door's
    layout (the speech patch count from the waveform's length alone) and the stage's patches
    (the encoder's ids filled in) equal upstream's get_audio_understanding_sft_prompt, every
    id of every frame; the waveform given at another rate is resampled first."""
    tok = build_tiny_text_tokenizer(tmp_path)
    speech = json.loads((FIXTURES / "tokenizer" / "config.json").read_text())
    proc = MiMoAudioInputProcessor(tok, speech, GROUP)
    assert proc.input_modalities == ("text", "audio")
    wav = fx["wav_short"].numpy()
    monkey = pytest.MonkeyPatch()     # the tiny tokenizer's 400 Hz is below any request's
    monkey.setattr(proc, "hear", lambda part, where: part["audio"])    # (checks: below)
    try:
        parsed = proc.parse_request({"messages": [{"role": "user", "content": [
            {"type": "audio", "audio": wav}, {"type": "text", "text": "Describe it."}]}]})
    finally:
        monkey.undo()
    ids = parsed.input_ids.tolist() + segment_ids(tok, list(TEXT_START))
    ref = fx["prompt"]                                   # (1 + channels, patches * group)
    assert ids == ref[0, ::GROUP].tolist()
    cfg = MiMoAudioConfig.from_folder(FIXTURES / "tiny", SpecialIds.of(tok).empty)
    patches = text_patches(ids, cfg)
    (start,) = parsed.audio_starts.tolist()
    rows = speech_patches(encoder.speech_ids(parsed.audio_waveforms, CHANNELS, GROUP), cfg)
    patches[start:start + rows.shape[0]] = rows
    assert torch.equal(patches[:, :, 1:].reshape(-1, CHANNELS).T, ref[1:])


def test_audio_parts_are_checked(tmp_path: Path) -> None:
    """Audio parts resampled to the tokenizer's rate (4 kHz here), bad ones refused naming
    the field; only a user turn hears."""
    speech = {**json.loads((FIXTURES / "tokenizer" / "config.json").read_text()),
              "sampling_rate": 4000}
    proc = MiMoAudioInputProcessor(build_tiny_text_tokenizer(tmp_path), speech, GROUP)
    heard = proc.parse_request({"messages": [{"role": "user", "content": [
        {"type": "audio", "audio": (np.zeros(5000, np.float32), 8000)}]}]})
    assert heard.audio_waveforms.shape[0] == 2500 and heard.audio_lens.tolist() == [2500]
    for audio, match in [((np.zeros(10, np.float32), 4000), "audio: too short"),
                         (np.zeros(64, np.float32), "sample_rate: needed"),
                         ((np.zeros(64, np.float32), 400), "sample_rate: 400 Hz"),
                         ((np.zeros((2, 64), np.float32), 4000), "audio: expected a 1-D"),
                         ((np.full(64, np.nan, np.float32), 4000), "audio: waveform has NaN")]:
        with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\." + match):
            proc.parse_request({"messages": [{"role": "user", "content": [
                {"type": "audio", "audio": audio}]}]})
    with pytest.raises(ValueError, match="not audio"):             # only a user turn hears
        proc.parse_request({"messages": [
            {"role": "assistant", "content": [{"type": "audio", "audio": (np.zeros(64), 4000)}]},
            {"role": "user", "content": "Hi"}]})
