"""The speech WebSocket's clauses for a multi-speaker model (registry.SpeechSpec.speakers > 1,
as VibeVoice's "Speaker N: ..." scripts): clauses.py cuts at ": " too, so a script arriving
word by word comes out as "Speaker 1:", "Hello there.", "Speaker 2:", "Hi,", "how are you?".
Each clause is its own request, so each must say who speaks:

    "Speaker 1:"        a label alone: remembered, not spoken
    "Hello there."   -> "Speaker 1: Hello there."      (the speaker carried over)
    "Hi,"            -> "Speaker 2: Hi,"

and a session's `voices` (one per speaker, in the order the speakers first speak in the
session) become each clause's own list: a clause of speaker 2 alone gets [voices[1]], as its
request's script has one speaker. Text before any label is speaker 0's line (the model's
rule for a plain text). A speaker past the session's voices is a 400 naming `voices`.
"""

from __future__ import annotations

import re
from typing import Any

from omnistage.entrypoints.openai.errors import bad_request

LABEL = re.compile(r"^[ \t]*speaker[ \t]*(\d+)[ \t]*:", re.IGNORECASE | re.MULTILINE)


class ScriptClauses:
    """One session's speakers: the current one and the order they first spoke in."""

    def __init__(self) -> None:
        self.current: str | None = None          # the label of the last line begun
        self.order: dict[str, int] = {}          # speaker number -> session index

    @staticmethod
    def _number(label: str) -> str:
        return label.lstrip("0") or "0"

    def clauses(self, cut: list[str]) -> list[str]:
        """The clauses cut, each with its speaker's label (label-only clauses dropped)."""
        out = []
        for text in cut:
            if not LABEL.match(text):
                text = f"Speaker {self.current or '0'}: {text}"
            labels = [self._number(m.group(1)) for m in LABEL.finditer(text)]
            for label in labels:
                self.order.setdefault(label, len(self.order))
            self.current = labels[-1]
            if LABEL.sub("", text).strip():
                out.append(text)
        return out

    def extra(self, extra: dict[str, Any], text: str, param: str = "voices"
              ) -> dict[str, Any]:
        """The session's `extra` for one clause: its speakers' voices only, in their order."""
        voices = extra.get("voices")
        if voices is None:
            return extra
        mine: list[Any] = []
        for label in dict.fromkeys(self._number(m.group(1)) for m in LABEL.finditer(text)):
            index = self.order[label]
            if index >= len(voices):
                raise bad_request(f"{param}: speaker {label} is the session's speaker "
                                  f"#{index + 1}, and the session has {len(voices)} voices "
                                  "(one per speaker, in the order they first speak)", param)
            mine.append(voices[index])
        return {**extra, "voices": mine}
