"""Where the WebSocket cuts text that is still arriving into clauses: after punctuation that a
space follows (a comma in "1,000" is no boundary), right after CJK punctuation, else at the
last space before the cap; flush hands over the rest."""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import pytest

from omnistage.entrypoints.openai import clauses
from omnistage.entrypoints.openai.clauses import ClauseBuffer

REPO = Path(__file__).resolve().parents[4]


def test_cuts_at_boundaries_once_they_are_certain() -> None:
    buf = ClauseBuffer(max_chars=200)
    assert buf.append("Hello there,") == []            # the comma may be "1,000"
    assert buf.append(" it costs 1,000 dollars. Then") == ["Hello there,",
                                                            "it costs 1,000 dollars."]
    assert buf.append(" more") == []
    assert buf.flush() == ["Then more"] and buf.flush() == []


def test_cjk_punctuation_cuts_at_once() -> None:
    assert ClauseBuffer(200).append("你好，世界。再见") == ["你好，", "世界。"]


def test_long_text_without_boundaries_is_cut_at_a_space_under_the_cap() -> None:
    buf = ClauseBuffer(max_chars=12)
    assert buf.append("aaaa bbbb cccc dddd") == ["aaaa bbbb"]      # "cccc dddd" may go on
    # no space left under the cap: cut at the cap itself
    assert buf.append("x" * 30) == ["cccc", "dddd" + "x" * 8, "x" * 12]
    assert buf.flush() == ["x" * 10]


def regex_cutter(text: str, max_chars: int) -> list[str]:
    """The cutter this module replaced (whole text at once): search the whole rest again
    after every cut; quadratic, but a reference for ordinary text."""
    boundary = re.compile(r"[.!?;:,\u2026]+[\"')\]]*\s+|[\u3002\uff01\uff1f\uff1b\uff1a"
                          r"\uff0c\u3001]+")
    out = []
    while True:
        m = boundary.search(text)
        if m is not None and m.end() <= max_chars:
            at = m.end()
        elif len(text) > max_chars:
            space = text.rfind(" ", 0, max_chars)
            at = space + 1 if space > 0 else max_chars
        else:
            return out
        piece, text = text[:at].strip(), text[at:]
        if piece:
            out.append(piece)


def test_ordinary_text_is_cut_where_the_regex_cutter_cut_it() -> None:
    """Words, numbers, quotes, brackets, CJK, long words: fed in random pieces, the clauses are
    those the old cutter made of the whole text."""
    rng = random.Random(5)
    words = ["well", "x" * 40, "y" * 90, "1,000", "3.5", "(so)", '"yes."', "ok!)", "no?!",
             "end...", "你好，", "世界。", "a;", "b:", "c,", "z" * 230]
    for _ in range(200):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 60))) + " "
        cap = rng.choice([12, 50, 200])
        buf, got, i = ClauseBuffer(cap), [], 0
        while i < len(text):
            n = rng.randint(1, 30)
            got += buf.append(text[i:i + n])
            i += n
        assert got == regex_cutter(text, cap), (text, cap)


# ---- hostile text: the cutter's work is linear in the text's length -------------------------

HOSTILE = {                        # name -> text; each used to take minutes to hours to cut
    "unbroken": "x" * (2 << 20),                      # no space, no punctuation
    "dots": "." * 200_000,                            # the old pattern backtracked over runs
    "closers": "a." + ")" * 200_000,                  # punctuation, then closers, no space
    "commas": ", " * 100_000,                         # a boundary every two characters
    "sparse spaces": ("y" * 150 + " ") * 10_000,      # the cap falls between spaces
}
CUT_IN_CHILD = """
import json, sys
from omnistage.entrypoints.openai.clauses import ClauseBuffer
for name, text in json.loads(sys.stdin.read()).items():
    buf = ClauseBuffer(200)
    clauses = buf.append(text) + buf.flush()
    print(json.dumps([name, len(clauses), max(map(len, clauses), default=0),
                      sum(len("".join(c.split())) for c in clauses)]), flush=True)
"""


class CountingPattern:
    """The boundary pattern, counting the characters each search goes through: up to the
    match's end, or the whole of what it was given."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern, self.num_chars = pattern, 0

    def search(self, text: str, pos: int = 0, endpos: int = sys.maxsize) -> re.Match[str] | None:
        m = self.pattern.search(text, pos, endpos)
        self.num_chars += (m.end() if m is not None else min(endpos, len(text))) - pos
        return m


@pytest.mark.parametrize("name", ["unbroken", "dots", "commas", "sparse spaces"])
def test_each_character_is_searched_a_bounded_number_of_times(
        monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Whether the text comes whole or in pieces of 7 characters, the searches together look at
    no more than a few times the text (the old cutter searched the whole rest after each cut)."""
    counting = CountingPattern(clauses._BOUNDARY)
    monkeypatch.setattr(clauses, "_BOUNDARY", counting)
    text = HOSTILE[name][:100_000]
    ClauseBuffer(200).append(text)
    assert counting.num_chars <= 3 * len(text), (name, counting.num_chars)
    counting.num_chars = 0
    buf = ClauseBuffer(200)
    for i in range(0, 20_000, 7):
        buf.append(text[i:i + 7])
    assert counting.num_chars <= (200 + 7) * (20_000 // 7 + 1), (name, counting.num_chars)
