"""The duplex runtime's clock and bookkeeping on a tiny random Moshi (engine/duplex.py): the
client's audio is heard one frame a tick, in order, and a tick with nothing buffered hears
silence (a missed input); a step that ends after the next tick was due is a missed tick,
counted per session and in all; the session limit, the input buffer's limit, and a closed
session's slot coming back."""

from __future__ import annotations

import threading
import time

import pytest

from omnistage.engine.duplex import DuplexRuntime, SessionsFull, TickEvent
from omnistage.stages.moshi_duplex import MoshiDuplex
from omnistage.testing.moshi_duplex import build_duplex_moshi

FRAME_BYTES = 1920 * 2


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> MoshiDuplex:
    path, _ = build_duplex_moshi(tmp_path_factory.mktemp("duplex_runtime") / "moshi")
    return MoshiDuplex(path, max_sessions=2, block_size=4)


class Collector:
    def __init__(self) -> None:
        self.events: list[TickEvent] = []
        self.ended: str | None = None
        self.got = threading.Condition()

    def __call__(self, ev: TickEvent | None, reason: str | None) -> None:
        with self.got:
            if ev is None:
                self.ended = reason
            else:
                self.events.append(ev)
            self.got.notify_all()

    def wait(self, num: int, timeout_s: float = 30.0) -> list[TickEvent]:
        with self.got:
            assert self.got.wait_for(lambda: len(self.events) >= num, timeout_s), self.events
            return list(self.events)


def test_frames_heard_in_order_silence_when_missing(model: MoshiDuplex) -> None:
    runtime = DuplexRuntime(model, tick_s=0.5)            # slow ticks: none is missed
    runtime.start()
    try:
        got = Collector()
        session = runtime.open(got)
        session.append(bytes(FRAME_BYTES * 2) + b"\x01\x00")    # 2 frames and one sample
        events = got.wait(5)
        assert [e.tick for e in events[:5]] == [0, 1, 2, 3, 4]
        assert [e.heard for e in events[:5]] == [False, True, True, True, True]
        assert [e.input_missed for e in events[:5]] == [False, False, False, True, True]
        assert events[0].audio is None and len(events[1].audio) == FRAME_BYTES
        assert not any(e.missed for e in events)
        assert session.stats.missed_inputs >= 2 and session.stats.missed_ticks == 0
        assert session.clear() == 2                       # the odd sample was never heard
        runtime.close(session)
        assert session.id not in runtime.live
    finally:
        runtime.shutdown()
    assert not runtime.is_alive


def test_late_steps_are_missed_ticks(model: MoshiDuplex) -> None:
    runtime = DuplexRuntime(model, tick_s=0.0005)         # no step is that fast
    runtime.start()
    try:
        got = Collector()
        session = runtime.open(got)
        events = got.wait(4)
        assert all(e.missed for e in events)
        time.sleep(0.05)
    finally:
        runtime.shutdown()
    assert got.ended == "shutdown"
    # read once the ticker has stopped: mid-tick, one count may lead the other
    stats = session.stats.summary()
    assert stats["missed_ticks"] == stats["ticks"] >= 4
    assert runtime.totals.missed_ticks >= 4 and stats["tick_latency_ms_p50"] > 0


def test_limits(model: MoshiDuplex) -> None:
    runtime = DuplexRuntime(model, tick_s=0.5, max_buffer_s=0.1)
    runtime.start()
    try:
        a, b = runtime.open(Collector()), runtime.open(Collector())
        with pytest.raises(SessionsFull, match="2 duplex sessions"):
            runtime.open(Collector())
        a.append(bytes(2400 * 2))                          # 0.1 s: the whole buffer
        with pytest.raises(ValueError, match="at most 4800 bytes"):
            a.append(b"\x00\x00")
        runtime.close(a)
        c = Collector()
        runtime.open(c)                                    # a's slot serves a new session
        c.wait(1)
        runtime.close(b)
    finally:
        runtime.shutdown()
