"""The fault-injection matrix's machinery (tests/system/engine/test_fault_matrix.py): a running engine
under load, one fault injected into one stage, and what followed, measured.

    load = Load(omni, prompts, params)         a few long requests submitted at once
    load.wait_started()                        every one has output: the stage holds work
    inject(omni, stage, fault, fault_dir)      SIGKILL / SIGTERM / SIGSTOP / segments removed /
                                               OOM, a hung step or a slow one (stages/faults.py)
    outcome = load.settle()                    each request's end (ok, or its error kind), the
                                               health when the first one failed; every wait
                                               has a deadline

The outcomes go to a JSON file (OMNISTAGE_FAULT_RESULTS) that scripts/reliability_doc.py
turns into docs/reliability.md.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from omnistage.connectors.shm import sweep
from omnistage.entrypoints.omni import Omni
from omnistage.outputs import RequestEvent
from omnistage.stages.faults import arm

FAULTS = ("sigkill", "sigterm", "sigstop", "segment", "oom", "hang", "slow")
HUNG_STEP_S = 30.0      # a hung step sleeps this long: far past any test's step_timeout_s
SLOW_STEP_S = 3.5       # a slow step sleeps this long, then returns: past the matrix's
                        # liveness_timeout_s, within its step_timeout_s


def health(omni: Omni) -> str:
    """What /health answers for this engine: 503, "degraded" (200) or "ok" (200)."""
    orch = omni.engine.orchestrator
    return "503" if not orch.healthy else ("degraded" if orch.degraded_reason else "ok")


@dataclass
class Outcome:
    ended: dict[str, str]          # request -> "ok" or its error kind ("stage_dead", ...)
    errors: dict[str, str]         # request -> its error line
    health_at_failure: str | None  # /health when the first request failed (None: none failed)
    seconds: float                 # from the fault to the last request's end


@dataclass
class Load:
    omni: Omni
    prompts: list
    params: list | None
    events: dict[str, list[RequestEvent]] = field(default_factory=dict)
    health_at_failure: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        for i, prompt in enumerate(self.prompts):
            rid = f"load-{time.monotonic_ns()}-{i}"
            self.events[rid] = []
            self.omni.engine.submit(prompt, self.params, rid, None, self._sink(rid))

    def _sink(self, rid: str):
        def sink(event: RequestEvent) -> None:   # on the router thread
            with self._lock:
                if event.error and self.health_at_failure is None:
                    self.health_at_failure = health(self.omni)
                self.events[rid].append(event)
        return sink

    def wait_started(self, timeout_s: float = 30.0) -> None:
        """Until every request has had output (the stages hold work), within the deadline."""
        wait_for(lambda: all(evs for evs in self.events.values()), timeout_s,
                 "the load produced no output")

    def settle(self, started: float, timeout_s: float = 30.0) -> Outcome:
        """Until every request has ended (no client waits forever): how each ended."""
        wait_for(lambda: all(evs and evs[-1].done for evs in self.events.values()), timeout_s,
                 "a request never ended")
        last = {rid: evs[-1] for rid, evs in self.events.items()}
        return Outcome({rid: "ok" if e.error is None else e.error.kind
                        for rid, e in last.items()},
                       {rid: str(e.error) for rid, e in last.items() if e.error},
                       self.health_at_failure, time.monotonic() - started)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:g} s")
        time.sleep(0.01)


def inject(omni: Omni, stage: str, fault: str, fault_dir: Path, rank: int = 0) -> None:
    """One fault into a running stage (its first replica; a signal to the given rank)."""
    orch = omni.engine.orchestrator
    pid = orch.stages.rank_pids[stage][rank]
    if fault in ("sigkill", "sigterm", "sigstop"):
        os.kill(pid, {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM,
                      "sigstop": signal.SIGSTOP}[fault])
    elif fault == "segment":
        _remove_segments(orch.resources["shm_namespace"], seconds=1.0)
    elif fault in ("oom", "hang"):
        arm(fault_dir, stage, fault, seconds=HUNG_STEP_S)
    elif fault == "slow":
        arm(fault_dir, stage, "hang", seconds=SLOW_STEP_S)
    else:
        raise ValueError(f"unknown fault {fault!r}")


def _remove_segments(namespace: str, seconds: float) -> None:
    """What `rm /dev/shm/*` by an operator does to the engine: every segment of its namespace
    unlinked, again and again, for a while."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sweep(namespace)
        time.sleep(0.002)


def leftovers(pids: list[int], namespace: str) -> tuple[list[int], list[str]]:
    """The processes still running and the /dev/shm segments left, after a shutdown."""
    from omnistage.testing.processes import alive

    segments = sorted(n for n in os.listdir("/dev/shm") if n.startswith(namespace + "_"))
    return [p for p in pids if alive(p)], segments
