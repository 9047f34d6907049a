"""Liveness apart from step progress (issue 37, item 3): a stage process that stops answering
(SIGSTOP, any rank of it) is killed within its `liveness_timeout_s`, with the default
`step_timeout_s` of 600 s, so its requests fail in seconds and /health says so; a step that
runs longer than `liveness_timeout_s` and then returns is not taken for a stopped process."""

from __future__ import annotations

import time

import pytest
import zmq

from omnistage.configs.schema import GraphConfig, ParallelSizes, StageConfig, Timeouts
from omnistage.engine.stage_set import StageSet
from omnistage.stages import messages as m

def test_the_liveness_beat_comes_from_a_thread_of_its_own() -> None:
    """Beats at its period on its own socket while the caller's thread does anything else;
    stopped, it closes its socket."""
    from omnistage.stages.liveness import LivenessThread

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("inproc://liveness-test")
    beat = LivenessThread(ctx, "inproc://liveness-test", "s", replica=1, rank=2, period_s=0.01)
    try:
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 3:
            assert time.monotonic() < deadline, got
            if pull.poll(100):
                got.append(m.decode_from_stage(pull.recv()))
        assert all(g == m.LivenessBeat("s", 1, 2) for g in got), got
    finally:
        beat.stop()
        pull.close()
    ctx.term()      # returns only once every socket, the beat's too, is closed


class _Runner:
    """What end_hung sees of a running stage process."""

    def __init__(self, stopped: bool | None = None) -> None:
        self.processes, self.hung, self.stopped = [object()], None, stopped

    def rank_stopped(self, rank: int) -> bool | None:
        return self.stopped

    def is_alive(self) -> bool:
        return self.hung is None

    def kill_hung(self, why: str) -> None:
        self.hung = why


def _judge(tp: int = 1) -> StageSet:
    """A StageSet's liveness book alone (no process): one stage, its Ready at t = 100."""
    stages = StageSet.__new__(StageSet)
    stages.graph = GraphConfig((StageConfig(name="s", kind="ar",
                                            timeouts=Timeouts(liveness_s=2.0, step_s=30.0),
                                            parallel=ParallelSizes(tp=tp)),))
    stages.runners, stages.down, stages.starting = {"s": [_Runner()]}, set(), {}
    stages.last_beat, stages.last_alive = {("s", 0): 100.0}, {("s", 0): [100.0] * tp}
    stages._judged_at = None
    return stages


def _run_router(stages: StageSet, start: float, end: float, beats: bool = False) -> None:
    """The router's iterations from `start` to `end`, every 50 ms, with or without beats."""
    t = start
    while t <= end:
        if beats:
            stages.last_beat[("s", 0)] = t
            stages.last_alive[("s", 0)] = [t] * len(stages.last_alive[("s", 0)])
        stages.end_hung(t)
        t += 0.05


def test_a_stall_of_the_router_itself_is_nobodys_silence() -> None:
    """The router starved for 5 s (this process short of CPU: seen on a loaded 2-core
    machine) reads no beat meanwhile; the stage is not killed for it, but one that stays
    silent while the router runs is, after liveness_timeout_s."""
    stages = _judge()
    _run_router(stages, 100.0, 101.0, beats=True)
    stages.end_hung(106.0)                        # 5 s without a turn of the router
    _run_router(stages, 106.05, 107.5)            # the beats of those 5 s on their way in
    assert stages.runners["s"][0].hung is None
    _run_router(stages, 107.55, 109.0)            # and then none: a stopped process
    assert stages.runners["s"][0].hung == "stopped answering (no liveness beat for 2 s)"


def test_a_silent_rank_or_loop_is_named() -> None:
    stages = _judge(tp=2)
    _run_router(stages, 100.0, 101.0, beats=True)
    stages.last_alive[("s", 0)][1] = 101.0        # rank 1 stops, rank 0 beats on
    t = 101.05
    while stages.runners["s"][0].hung is None and t < 110:
        stages.last_alive[("s", 0)][0] = stages.last_beat[("s", 0)] = t
        stages.end_hung(t)
        t += 0.05
    assert stages.runners["s"][0].hung == ("stopped answering (no liveness beat from rank 1 "
                                           "for 2 s)")
    assert 103.0 <= t <= 103.2, t
    stages = _judge()                             # a step that never returns: beats, no loop
    t = 100.0
    while stages.runners["s"][0].hung is None and t < 200:
        stages.last_alive[("s", 0)] = [t]
        stages.end_hung(t)
        t += 0.05
    assert stages.runners["s"][0].hung == "hung (no heartbeat for 30 s)"


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_liveness_timeout_must_be_positive(value: float) -> None:
    with pytest.raises(ValueError, match="liveness_s: must be > 0"):
        StageConfig(name="s", kind="ar", timeouts=Timeouts(liveness_s=value))


def test_a_silent_local_process_that_runs_is_busy_not_stopped() -> None:
    """No beat, but /proc shows the process running (a C call holding the GIL, say): no kill
    for silence; its loop is still held to step_timeout_s. Stopped, or not known (a remote
    rank): killed after liveness_timeout_s."""
    stages = _judge()
    stages.runners["s"][0].stopped = False
    _run_router(stages, 100.0, 120.0)
    assert stages.runners["s"][0].hung is None
    _run_router(stages, 120.0, 131.0)
    assert stages.runners["s"][0].hung == "hung (no heartbeat for 30 s)"
    for stopped in (True, None):
        stages = _judge()
        stages.runners["s"][0].stopped = stopped
        _run_router(stages, 100.0, 103.0)
        assert stages.runners["s"][0].hung == "stopped answering (no liveness beat for 2 s)"
