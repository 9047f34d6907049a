"""Where the WebSocket cuts text that is still arriving into clauses: after punctuation that a
space follows (a comma in "1,000" is no boundary), right after CJK punctuation, else at the
last space before the cap; flush hands over the rest."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path



REPO = Path(__file__).resolve().parents[4]


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


def test_hostile_text_is_cut_in_a_bounded_time() -> None:
    """2 MB without a space, 200 KB of dots, ...: cut in a child process under a 60 s deadline
    (the quadratic-and-worse cutter this replaces took over 20 minutes on the first and days
    on the second); every clause within the cap, no character lost."""
    done = subprocess.run([sys.executable, "-c", CUT_IN_CHILD], input=json.dumps(HOSTILE),
                          capture_output=True, check=False, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(done.stdout.splitlines()) == len(HOSTILE), done.stdout
    for line in done.stdout.splitlines():
        name, num_clauses, longest, num_chars = json.loads(line)
        assert num_clauses > 0 and longest <= 200, (name, num_clauses, longest)
        assert num_chars == sum(not c.isspace() for c in HOSTILE[name]), name


class CountingPattern:
    """The boundary pattern, counting the characters each search goes through: up to the
    match's end, or the whole of what it was given."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern, self.num_chars = pattern, 0

    def search(self, text: str, pos: int = 0, endpos: int = sys.maxsize) -> re.Match[str] | None:
        m = self.pattern.search(text, pos, endpos)
        self.num_chars += (m.end() if m is not None else min(endpos, len(text))) - pos
        return m

