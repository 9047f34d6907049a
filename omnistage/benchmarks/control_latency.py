"""Round trip of one control message, orchestrator -> stage -> orchestrator, by each way the
Ray backend could carry it (stages/ray_actor.py chose zmq over tcp):

    zmq ipc     the process backend's sockets (PUSH/PULL pair, an echo process)
    zmq tcp     the same over tcp on this host's address: what backend ray uses
    ray call    a Ray actor method that returns its argument (ray.get of each call)

The message is a msgspec-encoded EdgeChunk with a small inline payload, as a decode step's.
`python -m omnistage.benchmarks.control_latency [N]` prints the median and p99 in
microseconds; it starts (and ends) a local Ray cluster for the third row.
"""

from __future__ import annotations

import subprocess
import sys
import time

import zmq

from omnistage.stages import messages as m

ECHO = """
import sys, zmq
ctx = zmq.Context()
inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
inbox.connect(sys.argv[1]); outbox.connect(sys.argv[2])
while True:
    outbox.send(inbox.recv())
"""


def _message() -> bytes:
    return m.encode(m.EdgeChunk("request-0", "talker", 7, False, token_ids=list(range(16))))


def _summary(seconds: list[float]) -> str:
    us = sorted(s * 1e6 for s in seconds)
    return f"median {us[len(us) // 2]:.0f} us, p99 {us[int(len(us) * 0.99)]:.0f} us"


def zmq_round_trips(transport: str, n: int) -> list[float]:
    """Round trips to an echo process over zmq `transport` ("ipc" or "tcp")."""
    ctx = zmq.Context()
    out, back = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    if transport == "ipc":
        addresses = [f"ipc:///tmp/omnistage-latency-{i}" for i in range(2)]
        out.bind(addresses[0])
        back.bind(addresses[1])
    else:
        out.bind("tcp://127.0.0.1:*")
        back.bind("tcp://127.0.0.1:*")
        addresses = [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in (out, back)]
    echo = subprocess.Popen([sys.executable, "-c", ECHO, *addresses])
    try:
        return _time(lambda msg: (out.send(msg), back.recv()), n)
    finally:
        echo.kill()
        echo.wait()
        ctx.destroy(linger=0)


def ray_round_trips(n: int) -> list[float]:
    import ray

    ray.init(include_dashboard=False, num_cpus=1)
    try:
        @ray.remote(num_cpus=0)
        class Echo:
            def echo(self, data: bytes) -> bytes:
                return data

        echo = Echo.remote()
        ray.get(echo.echo.remote(b""))
        return _time(lambda msg: ray.get(echo.echo.remote(msg)), n)
    finally:
        ray.shutdown()


def _time(call, n: int) -> list[float]:
    msg = _message()
    for _ in range(100):     # warm-up: connections made, code paths hot
        call(msg)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call(msg)
        times.append(time.perf_counter() - t0)
    return times


if __name__ == "__main__":
    num = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    print("zmq ipc ", _summary(zmq_round_trips("ipc", num)))
    print("zmq tcp ", _summary(zmq_round_trips("tcp", num)))
    print("ray call", _summary(ray_round_trips(num)))
