"""Ends the local Ray cluster a process started once that process ends, however it ends
(SIGKILL included). Run as a script (standard library only) by ray_actor.connect:

    server (ray.init started a head)           reaper (this file, a session of its own)
      ├─ gcs_server, raylet, dashboard, ...       waits on the server's pid (a pidfd)
      │    └─ raylet ─ ray::DashboardAgent         then ends every process of the server's
      │              ├ ray::RuntimeEnvAgent         Ray session: SIGTERM, and SIGKILL to
      │              └ ray::<worker> ─ stage        what is left after GRACE_S
      └─ stdin of the reaper: the session folder, one line, once ray.init returns

Ray ties the head's processes to the driver (PR_SET_PDEATHSIG), but not the raylet's agents:
when the raylet dies they report its death to the GCS, which died with it, and block there up
to a minute (publish_error_to_driver; measured: both alive 30 s and more after a SIGKILL of
the server, Ray 2.60). By then Ray has renamed
them and they are init's children, so a process is found by its session folder: one of Ray's
programs (under ray_dir, Ray's package folder) whose command line names it (gcs_server, raylet,
dashboard, monitors), or one named ray::... with a file in it open (agents and workers: their
logs); with each such process, its descendants (a worker's stage process, which frees its
shared memory on the SIGTERM). A Ray driver of another program that joined the cluster, or a
`tail -f` of a log there, is neither: it is left alone.

An empty line on stdin: the server joined a cluster it did not start; the reaper ends. A server
that dies before it sent a line (during ray.init) has its session found by name: Ray names a
head's session folder session_<date>_<time>_<pid of the process that started it>.
"""

from __future__ import annotations

import os
import re
import select
import signal
import sys
import time

GRACE_S = 3.0       # SIGTERM, then SIGKILL: an agent blocked in its report never takes a SIGTERM
GIVE_UP_S = 30.0    # of scanning for the session's processes after the server ended


def main(server_pid: int, ray_dir: str) -> None:
    session = wait_for_exit(server_pid)
    if session == "":
        return
    pattern = re.escape(session.rstrip("/")) if session else rf"/session_[\d_-]+_{server_pid}"
    end_session(re.compile(pattern + r"(?=/|\s|$)"), ray_dir.rstrip("/") + "/")


def wait_for_exit(server_pid: int) -> str | None:
    """Block until the server ends. -> the session folder it sent, "" if it sent that it
    started none (without waiting for its end), None if it sent nothing."""
    session: str | None = None
    poller = select.poll()
    poller.register(sys.stdin.fileno(), select.POLLIN)
    try:
        pidfd = os.pidfd_open(server_pid)
        poller.register(pidfd, select.POLLIN)        # readable once the process ended
    except (AttributeError, OSError):
        pidfd = None                                 # no pidfd: poll for the parent's change
    while os.getppid() == server_pid:
        for fd, _ in poller.poll(None if pidfd is not None else 200):
            if fd == pidfd:
                return session
            line = sys.stdin.readline()
            poller.unregister(sys.stdin.fileno())    # one line, then EOF: nothing more
            if line == "\n":
                return ""
            session = line.strip() or None
    return session


def end_session(session: re.Pattern, ray_dir: str) -> None:
    """SIGTERM each process of the session as it is found, SIGKILL what is left after GRACE_S,
    until a scan finds none (or GIVE_UP_S passed)."""
    start = time.monotonic()
    termed: set[int] = set()
    while time.monotonic() - start < GIVE_UP_S:
        pids = members(session, ray_dir)
        if not pids:
            return
        late = time.monotonic() - start > GRACE_S
        for pid in pids - (set() if late else termed):
            try:       # one SIGTERM each: a second could cut a stage's clean-up short
                os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
            except ProcessLookupError:
                pass
        termed |= pids
        time.sleep(0.1)


def members(session: re.Pattern, ray_dir: str) -> set[int]:
    """The running processes of the session and their descendants (this reaper aside)."""
    stats = {pid: _stat(pid) for pid in _pids()}
    found = set()
    for pid, stat in stats.items():
        if stat is None or pid == os.getpid():
            continue
        line = _command_line(pid)
        if ((ray_dir in line and session.search(line))
                or (line.startswith("ray::") and _holds_file_in(pid, session))):
            found.add(pid)
    children: dict[int, list[int]] = {}
    for pid, stat in stats.items():
        if stat is not None:
            children.setdefault(stat[1], []).append(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid), None if gone or a zombie (nothing left to end)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else (fields[0], int(fields[1]))


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _holds_file_in(pid: int, session: re.Pattern) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False                                 # gone, or another user's
    for fd in fds:
        try:
            if session.search(os.readlink(f"/proc/{pid}/fd/{fd}")):
                return True
        except OSError:
            pass                                     # closed meanwhile
    return False


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the server's Ctrl-C is its own
    main(int(sys.argv[1]), sys.argv[2])
