"""Where the WebSocket cuts text that is still arriving into clauses: after punctuation that a
space follows (a comma in "1,000" is no boundary), right after CJK punctuation, else at the
last space before the cap; flush hands over the rest."""

from __future__ import annotations

from omnistage.entrypoints.openai.speech_stream import ClauseBuffer


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
