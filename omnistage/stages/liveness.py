"""A stage process's liveness beat: a daemon thread that tells the orchestrator, every
LIVENESS_PERIOD_S, that the process still runs, whatever its busy loop (or, on a follower
rank, its forward) is doing.

    process runs, any step however long   ->  a LivenessBeat every 0.5 s, from every rank
    process stopped (SIGSTOP, frozen host) ->  silence: killed after its liveness_timeout_s

Apart from the busy loop's Heartbeat (worker.py), which says that the loop turns and is held
to the much longer step_timeout_s: a long step (a big diffusion step, a first torch.compile)
stops that one, not this one; SIGSTOP stops both, since it stops every thread. The thread has
a PUSH socket of its own to the orchestrator's outputs (zmq sockets are not thread-safe) and
never blocks on it: a beat the socket cannot take now is dropped, the next one follows.
"""

from __future__ import annotations

import threading

import zmq

from omnistage.stages import messages as m

LIVENESS_PERIOD_S = 0.5
QUEUED_BEATS = 4        # the socket's high-water mark: a stale beat backlog says nothing


class LivenessThread:
    def __init__(self, ctx: zmq.Context, address: str, stage: str, replica: int = 0,
                 rank: int = 0, period_s: float = LIVENESS_PERIOD_S) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ctx, address, m.encode(m.LivenessBeat(stage, replica, rank)),
                                    period_s),
            name="liveness-beat", daemon=True)
        self._thread.start()

    def _run(self, ctx: zmq.Context, address: str, beat: bytes, period_s: float) -> None:
        sock = ctx.socket(zmq.PUSH)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, QUEUED_BEATS)
            sock.connect(address)
            while not self._stop.is_set():
                try:
                    sock.send(beat, zmq.NOBLOCK)
                except zmq.Again:
                    pass
                self._stop.wait(period_s)
        except zmq.ContextTerminated:
            return
        finally:
            sock.close()

    def stop(self, timeout_s: float = 2.0) -> None:
        """No more beats; the socket closed (before its context is destroyed)."""
        self._stop.set()
        self._thread.join(timeout_s)
