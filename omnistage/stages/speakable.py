"""When text that an LLM is still writing is safe to speak: the rule a voice-agent graph
(configs/voice_agent.yaml) applies on the edge from the text LLM to the TTS talker.

A talker tokenizes the text it is fed with its own tokenizer, one piece at a time. A piece is
released only when nothing later can change how it reads or tokenizes:

- **Whole words.** The text after the last whitespace is held back: the LLM may still be
  writing that word ("Hel" + "lo"), and a number is a word too ("1," + "000", "3." + "14"),
  so digits, decimal points and thousands separators are never spoken apart from their
  number. A piece therefore always ends before whitespace and the next one starts with it,
  which is where byte-level BPE pre-tokenizers (GPT-2's and Qwen's split before a space)
  cut anyway: the pieces' tokens are the whole text's tokens.
- **No markup.** Markdown the LLM writes for a screen is not read aloud: emphasis and code
  marks (`*`, `` ` ``, `~`), heading marks (`#` at a line's start), list bullets (`-`, `*`,
  `+` and a space at a line's start), the brackets and the target of a link
  (`[text](url)` reads "text"), and a link or URL written bare is kept (it is text the user
  may want to hear). Whitespace runs collapse to what they were (kept as written).
- **At the end** (the LLM finished) everything held back is released.

`SpeakableText.append(delta) -> piece` and `finish() -> piece` implement it; the pieces
concatenated equal `speakable(whole text)`.
"""

from __future__ import annotations

import re

# markup, removed wherever it is: emphasis / code / strike marks
_MARKS = re.compile(r"[*`~]")
# a heading's hashes or a list bullet at a line's start (after optional indentation)
_LINE_START = re.compile(r"(^|\n)([ \t]*)(#{1,6}[ \t]+|[-+*][ \t]+)")
# a link: keep its text, drop the target
_LINK = re.compile(r"\[([^\]\n]*)\]\([^)\s]*\)")


def speakable(text: str) -> str:
    """`text` as it is spoken: the markup removed (see the module's rule)."""
    text = _LINK.sub(r"\1", text)
    text = _LINE_START.sub(r"\1\2", text)
    return _MARKS.sub("", text)


class SpeakableText:
    """Text in as the LLM writes it; pieces out once they are safe to speak. Each release
    re-reads the markup of the whole prefix up to a safe cut (no link open, no line that is
    still only a heading mark or a bullet), so the pieces together are `speakable` of the
    whole text whatever the deltas were."""

    def __init__(self) -> None:
        self.text = ""          # everything written so far
        self.cut = 0            # characters of `text` released
        self.spoken = 0         # characters of speakable text released

    def append(self, delta: str) -> str:
        """The next safe piece ("" if none yet)."""
        self.text += delta
        return self._release(self._safe_cut())

    def finish(self) -> str:
        """Everything still held back (the LLM is done)."""
        return self._release(len(self.text))

    def _safe_cut(self) -> int:
        """The end of the longest releasable prefix: before the last whitespace run that
        follows a word, stepped back while a link or a line-start mark is still open."""
        cut = _word_start(self.text, len(self.text))
        while cut > self.cut:
            head = self.text[:cut]
            line = head[head.rfind("\n") + 1:]
            if head.count("[") <= head.count("]") and not _open_link_target(head) \
                    and not _MARK_ONLY.fullmatch(line):
                return cut
            cut = _word_start(self.text, cut)
        return self.cut

    def _release(self, cut: int) -> str:
        if cut <= self.cut:
            return ""
        spoken = speakable(self.text[:cut])
        piece = spoken[self.spoken:]
        self.cut, self.spoken = cut, len(spoken)
        return piece


# a line that so far holds only indentation and a heading / bullet mark
_MARK_ONLY = re.compile(r"[ \t]*(#{1,6}|[-+*])?")


def _word_start(text: str, end: int) -> int:
    """The start of the whitespace run before the word that `text[:end]` ends with (or, if
    it ends with whitespace, of that run): the cut that holds that word back; 0 if none."""
    i = end
    while i > 0 and not text[i - 1].isspace():
        i -= 1
    while i > 0 and text[i - 1].isspace():
        i -= 1
    return i


def _open_link_target(text: str) -> bool:
    """`text` ends inside a link's "(target" (opened after a "]", not closed)."""
    start = text.rfind("](")
    return start >= 0 and ")" not in text[start:]
