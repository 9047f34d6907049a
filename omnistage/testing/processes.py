"""Process checks the tests share: whether a pid still runs (a zombie does not), a free local
port for a server or a process group to listen on, and the processes a server caused to exist:
its descendants, and those that name a folder of its (a Ray session's daemons, which outlive
their parents and rename themselves: ray::DashboardAgent keeps only its open log files)."""

from __future__ import annotations

import os
import socket


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def started(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): a pid with the same start time is
    the same process. None once it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def still_running(processes: dict[int, int]) -> dict[int, int]:
    """Those of `processes` ({pid: start time}) that still run (not a later process that
    reused the pid)."""
    return {pid: t for pid, t in processes.items() if started(pid) == t}


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(pid: int) -> set[int]:
    """Every process below `pid` in the process tree now (children, theirs, ...)."""
    children: dict[int, list[int]] = {}
    for p in _pids():
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
        children.setdefault(ppid, []).append(p)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def naming(folder: str) -> set[int]:
    """The processes whose command line names `folder`, or that have a file in it open or
    it as their working directory (this user's processes; others' cannot be read)."""
    folder = folder.rstrip("/")
    found = set()
    for p in _pids():
        if p == os.getpid():
            continue
        if folder + "/" in command_line(p) + "/":
            found.add(p)
            continue
        if any(link == folder or link.startswith(folder + "/") for link in _open_paths(p)):
            found.add(p)
    return found


def _open_paths(pid: int) -> list[str]:
    """The process's working directory and open files (none if gone or not ours)."""
    paths = []
    try:
        names = ["cwd"] + [f"fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return paths
    for name in names:
        try:
            paths.append(os.readlink(f"/proc/{pid}/{name}"))
        except OSError:
            pass          # closed meanwhile
    return paths
