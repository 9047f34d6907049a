"""VibeVoice's script -> prompt ids (models/vibevoice/script.py): speakers renumbered from 0
in the order they first speak, unlabelled lines joined to the line before, the voice section
only with clips, the prompt ending at audio_bos."""

from __future__ import annotations

import pytest

from omnistage.models.vibevoice.config import SpeechTokenIds
from omnistage.models.vibevoice.script import Script, parse_script, script_ids

TOKENS = SpeechTokenIds(audio_bos=-1, audio_eos=-2, audio=-3, eos=-4)


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_speakers_are_renumbered_in_order_and_lines_continue() -> None:
    script = parse_script("Speaker 3: Hi there\n  and more.\nspeaker 1:Yes.\nSpeaker 3: Bye.")
    assert script == Script(((0, "Hi there and more."), (1, "Yes."), (0, "Bye.")), 2)
    assert parse_script("Just words.") == Script(((0, "Just words."),), 1)
    with pytest.raises(ValueError, match="no words"):
        parse_script("Speaker 1:   \n")


def test_ids_lay_out_the_voice_and_text_sections() -> None:
    script = parse_script("Speaker 1: A\nSpeaker 2: B")
    ids = script_ids(chars, TOKENS, script, [2, 1])
    text = "".join(chr(i) if i >= 0 else f"<{-i}>" for i in ids)
    assert text.endswith(" Voice input:\n Speaker 0:<1><3><3><2>\n Speaker 1:<1><3><2>\n"
                         " Text input:\n Speaker 0: A\n Speaker 1: B\n Speech output:\n<1>")
    bare = script_ids(chars, TOKENS, script, None)
    assert "Voice input" not in "".join(chr(i) for i in bare if i >= 0) and bare[-1] == -1
    with pytest.raises(ValueError, match="2 speakers"):
        script_ids(chars, TOKENS, script, [2])
