"""A multi-speaker script cut into clauses as its words arrive: each clause carries its
speaker's label and that speaker's voice (speech_stream_script.py)."""

from __future__ import annotations

import pytest

from omnistage.entrypoints.openai.clauses import ClauseBuffer
from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.speech_stream_script import ScriptClauses


def cut(text: str) -> tuple[ScriptClauses, list[str]]:
    buffer, script, out = ClauseBuffer(200), ScriptClauses(), []
    for word in text.split(" "):
        out += script.clauses(buffer.append(word + " "))
    return script, out + script.clauses(buffer.flush())


def test_each_clause_says_who_speaks_it() -> None:
    script, clauses = cut("Speaker 1: Hello there.\nSpeaker 2: Hi, how are you?\n"
                          "Speaker 01: Fine.")
    assert clauses == ["Speaker 1: Hello there.", "Speaker 2: Hi,", "Speaker 2: how are you?",
                       "Speaker 1: Fine."]
    assert script.order == {"1": 0, "2": 1}
    assert cut("Hello there. Bye.")[1] == ["Speaker 0: Hello there.", "Speaker 0: Bye."]


def test_each_clause_gets_its_speakers_voices() -> None:
    script, clauses = cut("Speaker 3: Hi.\nSpeaker 7: Yes.\nSpeaker 3: No.")
    extra = {"voices": ["a", "b"], "language": "en"}
    assert [script.extra(extra, c)["voices"] for c in clauses] == [["a"], ["b"], ["a"]]
    assert script.extra({"ref_audio": "x"}, clauses[0]) == {"ref_audio": "x"}
    with pytest.raises(APIError) as err:
        script.extra({"voices": ["a"]}, clauses[1], "session.voices")
    assert err.value.status == 400 and err.value.param == "session.voices"
