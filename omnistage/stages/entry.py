"""A stage process's entry point: `python -m omnistage.stages.entry`, started by
`launch.start_stage_process` with a pickled `ProcessStart` on its stdin.

A module of our own rather than multiprocessing's spawn: spawn's child runs the parent's main
script again (`spawn.prepare` imports `sys.modules['__main__'].__file__` as `__mp_main__`), so a
script that built an engine at import time started engines recursively, and a script read from
stdin could not be found at all. This child imports omnistage and nothing of the user's.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import sys
from multiprocessing import resource_tracker

TITLE_PREFIX = "omnistage: stage "


def set_title(title: str) -> None:
    """Name this process in ps / top: the whole command line with setproctitle (a
    dependency); without it, the kernel's 15-character name (prctl PR_SET_NAME), which
    `ps -o comm` and `top` show."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(15, title.replace(TITLE_PREFIX, "omnistage:").encode()[:15])  # PR_SET_NAME
        return
    setproctitle(title)


def main() -> None:
    try:
        start = pickle.loads(sys.stdin.buffer.read())
    except (EOFError, pickle.UnpicklingError):   # the parent died before it sent them
        sys.exit("omnistage stage process: no start arguments on stdin (is the parent gone?)")
    devnull = os.open(os.devnull, os.O_RDONLY)   # the pipe is spent; nothing reads stdin after
    os.dup2(devnull, 0)
    os.close(devnull)
    set_title(TITLE_PREFIX + start.spec.stage
              + (f" replica {start.spec.replica}" if start.spec.replica else "")
              + (f" rank {start.spec.rank}" if start.spec.rank else ""))
    sys.path[:] = list(start.sys_path)
    # what spawn.prepare does: share the parent's tracker instead of starting one per stage
    resource_tracker._resource_tracker._fd = start.tracker_fd  # type: ignore[attr-defined]
    from omnistage.stages.process import process_main

    process_main(start.spec, start.parent_pid, start.log_level)


if __name__ == "__main__":
    main()
