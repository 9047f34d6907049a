"""A step's device wait handles the inbox's EdgeChunks (utils/device_wait.py), in order, and
never an add or an abort while the engine is mid-step."""

from __future__ import annotations

import threading

import pytest
import zmq

from omnistage.configs.graph import load_graph
from omnistage.connectors.inproc import InprocConnector
from omnistage.stages import messages as m
from omnistage.stages import worker as worker_mod
from omnistage.stages.interface import StageResult
from omnistage.utils import device_wait

GRAPH = """
stages:
  - {name: up, kind: ar, component: x}
  - {name: down, kind: ar, component: x, final: text,
     inputs: [{from: up, adapter: tensors, chunked: true}]}
"""


class FakeEvent:
    """Completes after `busy` queries, as a device that is busy that long."""

    def __init__(self, busy: int) -> None:
        self.busy = busy

    def query(self) -> bool:
        self.busy -= 1
        return self.busy < 0


class FakeEngine:
    """Logs what reaches it; its step waits for a fake device, as the talker's frame does."""

    def __init__(self, busy: int) -> None:
        self.busy = busy
        self.log: list[tuple] = []
        self.stepping = False
        self.requests: set[str] = set()
        self.entered = threading.Event()    # a step has begun
        self.queued = threading.Event()     # set by the test once the inbox holds its messages

    def add(self, request) -> None:
        assert not self.stepping, "an add reached the engine mid-step"
        self.requests.add(request.request_id)
        self.log.append(("add", request.request_id))

    def feed(self, request_id, feed) -> None:
        self.log.append(("feed", request_id, self.stepping))

    def close_input(self, request_id) -> None:
        self.log.append(("close", request_id, self.stepping))

    def abort(self, request_id) -> None:
        assert not self.stepping, "an abort reached the engine mid-step"
        self.requests.discard(request_id)
        self.log.append(("abort", request_id))

    def step(self) -> list[StageResult]:
        self.entered.set()
        assert self.queued.wait(10)
        self.stepping = True
        done = device_wait.wait_for(FakeEvent(self.busy))
        self.stepping = False
        self.log.append(("step", done))
        return [StageResult(r) for r in sorted(self.requests)]

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch):
    engine = FakeEngine(busy=100)
    monkeypatch.setattr(worker_mod, "build_stage_engine", lambda *a: engine)
    graph = load_graph(GRAPH, adapters={"tensors"})
    return worker_mod.StageWorker(graph.stages[1], graph, InprocConnector(), "cpu"), engine


def _chunk(rid: str, idx: int, last: bool = False) -> m.EdgeChunk:
    return m.EdgeChunk(rid, "up", idx, last, text="x")


def test_chunks_are_handled_in_the_wait_and_others_after_it(worker) -> None:
    w, engine = worker
    ctx = zmq.Context.instance()
    inbox, feeder = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    outbox, sink = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    inbox.bind("inproc://dw-in"), feeder.connect("inproc://dw-in")
    outbox.bind("inproc://dw-out"), sink.connect("inproc://dw-out")
    feeder.send(m.encode(m.AddRequest("a", num_upstream=1)))
    serving = threading.Thread(target=w.serve, args=(inbox, outbox), daemon=True)
    serving.start()
    assert engine.entered.wait(10)
    # queued while the first step runs: two chunks, an add, a chunk of the new request, an abort
    for msg in (_chunk("a", 0), _chunk("a", 1), m.AddRequest("b", num_upstream=1),
                _chunk("b", 0, last=True), m.AbortRequest("a"), m.Shutdown()):
        feeder.send(m.encode(msg))
    engine.queued.set()
    serving.join(10)
    assert not serving.is_alive()
    feeds = [e for e in engine.log if e[0] in ("feed", "close", "add", "abort")]
    # the chunks of "a" came during a step's wait; "b"'s add waited for the step's end, so
    # its chunk (after the add) came after it too, then the abort, all in order
    assert feeds[0] == ("add", "a")
    assert feeds[1:3] == [("feed", "a", True), ("feed", "a", True)]
    assert [e[:2] for e in feeds[3:]] == [("add", "b"), ("feed", "b"), ("close", "b"),
                                          ("abort", "a")]
    assert any(e[0] == "step" and e[1] == 2 for e in engine.log)
    for s in (inbox, feeder, outbox, sink):
        s.close(0)


def test_wait_for_stops_when_the_device_is_done_or_the_work_runs_out() -> None:
    units = []

    def work() -> bool:
        units.append(1)
        return len(units) < 5
    assert device_wait.wait_for(FakeEvent(busy=3)) == 0          # no work registered
    with device_wait.idle_work(work):
        assert device_wait.wait_for(FakeEvent(busy=3)) == 3      # the device finished first
        units.clear()
        assert device_wait.wait_for(FakeEvent(busy=100)) == 4    # the work ran out
    assert device_wait.wait_for(FakeEvent(busy=3)) == 0          # unregistered again


def test_an_idle_stage_gathers_a_burst_of_requests_into_its_first_step(
        worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests sent at once reach a stage a little apart: the first step waits for the
    burst's end (a gap of GATHER_GAP_MS, widened here so the test does not race)."""
    w, engine = worker
    monkeypatch.setattr(worker_mod, "GATHER_GAP_MS", 500)
    monkeypatch.setattr(worker_mod, "GATHER_MAX_MS", 5000)
    engine.busy = 0
    engine.queued.set()
    steps: list[set[str]] = []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: steps.append(set(engine.requests)) or step())
    ctx = zmq.Context.instance()
    inbox, feeder = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    outbox, sink = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    inbox.bind("inproc://dw-g-in"), feeder.connect("inproc://dw-g-in")
    outbox.bind("inproc://dw-g-out"), sink.connect("inproc://dw-g-out")
    serving = threading.Thread(target=w.serve, args=(inbox, outbox), daemon=True)
    serving.start()
    feeder.send(m.encode(m.AddRequest("a", num_upstream=1)))
    threading.Event().wait(0.05)
    feeder.send(m.encode(m.AddRequest("b", num_upstream=1)))
    assert sink.poll(5000)
    feeder.send(m.encode(m.Shutdown()))
    serving.join(10)
    assert steps[0] == {"a", "b"}
    for s in (inbox, feeder, outbox, sink):
        s.close(0)
