"""The rule for when an LLM's text is safe to speak (stages/speakable.py): whole words only,
numbers never split, markup removed, and the pieces together equal the whole text's
speakable form however the text was cut into deltas."""

from __future__ import annotations

import random

import pytest

from omnistage.stages.adapters import EdgeData, speakable_text
from omnistage.stages.speakable import SpeakableText, speakable

TEXTS = [
    "Hello world, how are you?",
    "## Title\n- item one\n- item **two** and `code`\nSee [the docs](http://x.y/z) now.",
    "It costs 1,000.50 dollars - maybe 3.14 more.",
    "  leading spaces\n\n# H\ntext",
    "[an open bracket and more words",
    "a*b*c ~~strike~~ end\n+ plus bullet\n* star bullet",
    "你好，世界。 Mixed text",
]


def feed(text: str, seed: int) -> list[str]:
    rng, buffer, out, i = random.Random(seed), SpeakableText(), [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(buffer.append(text[i:i + n]))
        i += n
    out.append(buffer.finish())
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_the_whole_texts_speakable_form(text: str) -> None:
    for seed in range(50):
        assert "".join(feed(text, seed)) == speakable(text)


def test_markup_is_not_spoken() -> None:
    assert speakable(TEXTS[1]) == "Title\nitem one\nitem two and code\nSee the docs now."
    assert speakable(TEXTS[5]) == "abc strike end\nplus bullet\nstar bullet"
    assert speakable("a - b and -5") == "a - b and -5"     # a dash mid-line is text


def test_words_and_numbers_are_held_until_they_end() -> None:
    buffer = SpeakableText()
    assert [buffer.append(d) for d in ("Hel", "lo wor", "ld, ", "it is 1", ",0", "00 ")] == \
        ["", "Hello", " world,", " it is", "", " 1,000"]
    assert buffer.finish() == " "          # the whole text's trailing space (a talker drops it)
    buffer = SpeakableText()
    assert buffer.append("3.") == "" and buffer.append("14 is pi") == "3.14 is"
    assert buffer.finish() == " pi"


def test_a_link_or_a_line_mark_is_held_until_it_is_whole() -> None:
    buffer = SpeakableText()
    assert buffer.append("see [the docs](http") == "see"
    assert buffer.append("://x.y) now ") == " the docs now"
    buffer = SpeakableText()
    assert buffer.append("intro\n##") == "intro"
    assert buffer.append(" Heading ") == "\nHeading"


def test_the_edge_adapter_releases_pieces_and_the_rest_at_the_end() -> None:
    state: dict = {}
    first = speakable_text(EdgeData("r", "llm", 0, False, text="Hello wor"), state)
    assert first is not None and first.text == "Hello"
    assert speakable_text(EdgeData("r", "llm", 1, False, text="l"), state) is None
    last = speakable_text(EdgeData("r", "llm", 2, True, text="d!"), state)
    assert last is not None and last.text == " world!"
