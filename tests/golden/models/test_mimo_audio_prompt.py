"""MiMo-Audio's prompts (models/mimo_audio/prompt.py, what the served LLM stage is fed) against
upstream's own prompt methods at the pinned commit (tests/fixtures/mimo_audio/prompts.json,
scripts/mimo_audio_prompt_fixtures.py) on the same tiny tokenizer: text to speech
(get_tts_sft_prompt: the template, the capitalising, Chinese) and text chat
(get_text_dialogue_sft_multiturn_prompt, two turns), id for id."""

from __future__ import annotations

import json

import pytest

from omnistage.models.mimo_audio.config import MiMoAudioConfig
from omnistage.models.mimo_audio.prompt import (SPEECH_START, TEXT_START, MiMoAudioInputProcessor,
                                                segment_ids, text_patches)
from tests.helpers.mimo_audio import FIXTURES, build_tiny_text_tokenizer


@pytest.fixture(scope="module")
def fx() -> dict:
    return json.loads((FIXTURES / "prompts.json").read_text())


@pytest.fixture(scope="module")
def proc(tmp_path_factory: pytest.TempPathFactory) -> MiMoAudioInputProcessor:
    return MiMoAudioInputProcessor(build_tiny_text_tokenizer(tmp_path_factory.mktemp("tok")))


def test_tts_prompts_equal_upstream(fx: dict, proc: MiMoAudioInputProcessor) -> None:
    tail = segment_ids(proc.tokenizer, list(SPEECH_START))
    for case in fx["tts"]:
        assert proc.parse_request(case["text"]).input_ids.tolist() + tail == case["ids"], case
    assert fx["tts"][0]["ids"] != fx["tts"][1]["ids"]


def test_text_chat_prompts_equal_upstream(fx: dict, proc: MiMoAudioInputProcessor) -> None:
    tail = segment_ids(proc.tokenizer, list(TEXT_START))
    for case in fx["text_chat"]:
        got = proc.parse_request({"messages": case["messages"]}).input_ids.tolist()
        assert got + tail == case["ids"], case


def test_patches_and_refusals(proc: MiMoAudioInputProcessor) -> None:
    cfg = MiMoAudioConfig.from_folder(FIXTURES / "tiny", empty_idx=299)
    p = text_patches([5, 7], cfg)
    assert p.shape == (2, 4, 9) and p[1, 0, 0] == 7
    assert p[0, :, 1:].tolist() == [list(cfg.empty_ids)] * 4
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: .*not input_audio"):
        proc.parse_request({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hi"}, audio]}]})
    with pytest.raises(ValueError, match="last message is the user's"):
        proc.parse_request({"messages": [{"role": "assistant", "content": "Hi"}]})
