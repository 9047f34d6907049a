"""Where text that is still arriving is cut into clauses (the speech WebSocket speaks each one
as its own request): after western punctuation that whitespace follows (closing quotes and
brackets may come between; the comma of "1,000" is no boundary), right after CJK punctuation,
else, with no boundary within `max_chars`, after the last space before the cap, or at the cap.

The work is linear in the text, whatever the text (a run of dots, megabytes without a space):

    | cut | ....... window: at most max_chars ....... | rest of the text (not looked at) |
          ^ pos                                     ^ pos + max_chars = endpos

- each search looks at one window from the last cut (a boundary whose whitespace runs past
  the window is cut at its end); a search that finds a boundary looked only up to it and the
  cut falls there, so such searches do not overlap; a window without one is cut after its
  last space (or at its end), and what the next window looks at again was space-free, so
  within one call no character is searched more than twice (`rfind` looks at each once);
  what is left for the next call (at most max_chars) is searched again then: a call costs
  O(len(text) + max_chars);
- the pattern starts at one punctuation mark, not at a run of them, so a failed start costs
  O(1) plus the run of closers after it, never the rest of a run (the old `[.!?]+...\\s+`
  backtracked over every suffix of a run of dots: cubic time);
- the text is copied once per append (what is left is at most max_chars), not once per cut.
"""

from __future__ import annotations

import re

# one mark, its closers, the whitespace after it | a run of CJK marks (each ends a clause)
_BOUNDARY = re.compile(r"[.!?;:,\u2026][\"')\]]*\s+|[\u3002\uff01\uff1f\uff1b\uff1a\uff0c\u3001]+")


class ClauseBuffer:
    """Text in as it comes; clauses out once their end is known."""

    def __init__(self, max_chars: int) -> None:
        assert max_chars >= 1, f"max_chars={max_chars}"
        self.max_chars = max_chars
        self.text = ""          # not yet cut: at most max_chars after each call

    def __len__(self) -> int:
        return len(self.text)

    def append(self, text: str) -> list[str]:
        self.text += text
        return self._cut()

    def flush(self) -> list[str]:
        """The clauses, then whatever is left as one more."""
        clauses, rest = self._cut(), self.text.strip()
        self.text = ""
        return [*clauses, rest] if rest else clauses

    def clear(self) -> None:
        self.text = ""

    def _cut(self) -> list[str]:
        text, pos, cap, out = self.text, 0, self.max_chars, []
        while True:
            m = _BOUNDARY.search(text, pos, pos + cap)
            if m is not None:
                at = m.end()
            elif len(text) - pos > cap:              # no boundary in reach: the last space
                space = text.rfind(" ", pos, pos + cap)
                at = space + 1 if space > pos else pos + cap
            else:
                break
            piece = text[pos:at].strip()
            if piece:
                out.append(piece)
            pos = at
        self.text = text[pos:]
        return out
