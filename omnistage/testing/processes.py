"""Process checks the tests share: whether a pid still runs (a zombie does not)."""

from __future__ import annotations


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
