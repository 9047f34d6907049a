"""Voxtral-TTS's speech prompt from tekken.json (models/voxtral_tts/tekken.py) equals
mistral-common's `encode_speech_request(SpeechRequest(input, voice))` on the tiny fixture
(tests/fixtures/voxtral_tts/tekken/, written by scripts/voxtral_tts_tekken.py): the release's
v7 split pattern, byte fallback, merges, accents, digits, newlines, each preset voice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnistage.models.voxtral_tts.tekken import Tekken

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "voxtral_tts" / "tekken"


def test_speech_prompt_equals_mistral_common() -> None:
    tok = Tekken.from_file(FIXTURE / "tekken.json")
    cases = json.loads((FIXTURE / "expected.json").read_text())
    assert len(cases) == 8 and any(len(c["ids"]) > 25 for c in cases)
    for case in cases:
        assert tok.speech_prompt(case["input"], case["voice"]) == case["ids"], case["input"]


def test_merges_matter_and_unknown_voice_is_named() -> None:
    tok = Tekken.from_file(FIXTURE / "tekken.json")
    case = json.loads((FIXTURE / "expected.json").read_text())[0]
    tok.ranks = {k: v for k, v in tok.ranks.items() if len(k) == 1}   # bytes only
    tok._bpe.cache_clear()
    assert tok.speech_prompt(case["input"], case["voice"]) != case["ids"]
    with pytest.raises(KeyError, match="nobody"):
        tok.speech_prompt("hi", "nobody")
