"""The full-duplex session runtime: every session listens and speaks at once, at the model's
frame rate. One thread ticks all sessions together:

    every tick_s (80 ms for Moshi: 1920 samples at 24 kHz)
      opens / closes asked for since the last tick      (the model's requests come and go)
      each joined session's next frame from its inbox    (none buffered: silence, a missed input)
      model.tick(frames)                                 (one batched step: stages/moshi_duplex.py)
      each session's TickEvent to its `deliver`          (text token, audio frame, timing)
    a step that ends after the next tick was due is a missed tick for every session in it;
    the next tick then starts at once (the clock restarts there, no burst of catch-up ticks)

The client's audio waits in the session's inbox (PCM16, at most `max_buffer_s` of it): a
client sending faster than real time is heard frame by frame, one a tick, as the model would
have heard it live. `deliver` is called on the ticker thread; an asyncio caller hands the
event over with `loop.call_soon_threadsafe`. A session's end (`deliver(None, reason)`) comes
when the model's context is used up ("max_length"), the model fails ("error") or the runtime
shuts down ("shutdown"); `close` ends it without a call.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from omnistage.stages.moshi_duplex import DuplexSampling, MoshiDuplex, TickOutput

logger = logging.getLogger(__name__)
LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.12, 0.16, 0.25, 0.5, 1.0)


@dataclass(frozen=True, slots=True)
class TickEvent:
    """One session's output of one tick."""
    tick: int                    # the session's tick count, from 0 (the tick it joined)
    text_id: int                 # Moshi's inner-monologue token
    text: str
    codes: list[int] | None      # Moshi's frame (K codes); None at the joining tick
    audio: bytes | None          # that frame as PCM16 little-endian at the model's rate
    heard: bool                  # the tick consumed one input frame
    input_missed: bool           # ... which was silence: the client's audio had not come
    latency_ms: float            # the batched step's wall time
    missed: bool                 # the step ended after the next tick was due


class SessionsFull(Exception):
    """The runtime already serves its maximum of sessions."""


@dataclass(slots=True)
class SessionStats:
    ticks: int = 0
    missed_ticks: int = 0
    missed_inputs: int = 0
    latencies_ms: deque[float] = field(default_factory=lambda: deque(maxlen=4096))

    def summary(self) -> dict[str, float | int]:
        lat = sorted(self.latencies_ms)

        def pct(q: float) -> float:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else 0.0
        return {"ticks": self.ticks, "missed_ticks": self.missed_ticks,
                "missed_inputs": self.missed_inputs, "tick_latency_ms_p50": pct(0.5),
                "tick_latency_ms_p99": pct(0.99), "tick_latency_ms_max": pct(1.0)}


Deliver = Callable[[TickEvent | None, str | None], None]


class DuplexSession:
    """A session's side of the runtime: its inbox of PCM16 bytes and its counters."""

    def __init__(self, deliver: Deliver, max_buffer_bytes: int) -> None:
        self.id = "duplex_" + uuid.uuid4().hex[:20]
        self.deliver = deliver
        self.max_buffer_bytes = max_buffer_bytes
        self.stats = SessionStats()
        self.joined = False
        self.sampling: DuplexSampling | None = None     # None: greedy
        self._inbox = bytearray()
        self._lock = threading.Lock()

    def append(self, pcm16: bytes) -> None:
        """Queue the client's audio; ValueError (nothing queued) past the buffer's limit."""
        with self._lock:
            if len(self._inbox) + len(pcm16) > self.max_buffer_bytes:
                raise ValueError(f"the input buffer holds at most {self.max_buffer_bytes} "
                                 f"bytes not yet heard ({len(self._inbox)} waiting)")
            self._inbox += pcm16

    def clear(self) -> int:
        with self._lock:
            n = len(self._inbox)
            self._inbox.clear()
            return n

    def take(self, num_bytes: int) -> bytes | None:
        with self._lock:
            if len(self._inbox) < num_bytes:
                return None
            chunk = bytes(self._inbox[:num_bytes])
            del self._inbox[:num_bytes]
            return chunk


@dataclass(slots=True)
class RuntimeTotals:
    ticks: int = 0
    missed_ticks: int = 0                   # session-ticks
    missed_inputs: int = 0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS_S))
    latency_sum_s: float = 0.0
    latency_count: int = 0


class DuplexRuntime:
    def __init__(self, model: MoshiDuplex, tick_s: float | None = None,
                 max_buffer_s: float = 20.0) -> None:
        self.model = model
        self.tick_s = tick_s if tick_s is not None else model.frame_size / model.sample_rate
        if self.tick_s <= 0:
            raise ValueError(f"tick_s={self.tick_s}: must be > 0")
        self.max_buffer_bytes = int(max_buffer_s * model.sample_rate) * 2
        self.max_sessions = model.max_sessions
        self.totals = RuntimeTotals()
        self.live: dict[str, DuplexSession] = {}
        self._to_open: list[DuplexSession] = []
        self._to_close: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="duplex-ticker", daemon=True)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def frame_bytes(self) -> int:
        return self.model.frame_size * 2

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if not self._thread.is_alive():          # the model is ours again: free its requests
            for sid in list(self.model.sessions):
                self.model.close(sid)
        for session in list(self.live.values()):
            _deliver(session, None, "shutdown")
        self.live.clear()

    def open(self, deliver: Deliver, sampling: DuplexSampling | None = None) -> DuplexSession:
        """A new session, ticking from the next tick; SessionsFull at the maximum."""
        with self._lock:
            if len(self.live) >= self.max_sessions:
                raise SessionsFull(f"the server already serves {self.max_sessions} duplex "
                                   "sessions, its maximum (--max-num-seqs)")
            session = DuplexSession(deliver, self.max_buffer_bytes)
            session.sampling = sampling
            self.live[session.id] = session
            self._to_open.append(session)
        return session

    def close(self, session: DuplexSession) -> None:
        """End a session now (its slot is free at once, its request at the next tick)."""
        with self._lock:
            if self.live.pop(session.id, None) is not None:
                self._to_close.append(session.id)

    # -- the ticker thread -------------------------------------------------------------------
    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            wait = due - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                break
            sessions = self._admit()
            if not sessions:
                due = time.monotonic() + self.tick_s
                continue
            start = time.monotonic()
            frames = {s.id: self._frame(s) for s in sessions if s.joined}
            try:
                outs = self.model.tick(frames)
            except Exception:
                logger.exception("duplex tick failed: ending its %d sessions", len(sessions))
                for s in sessions:
                    self._end(s, "error")
                due = time.monotonic() + self.tick_s
                continue
            end = time.monotonic()
            missed = end > due + self.tick_s
            self._count(end - start, missed, len(sessions))
            for s in sessions:
                self._emit(s, outs[s.id], frames, end - start, missed)
            due = end if missed else due + self.tick_s

    def _admit(self) -> list[DuplexSession]:
        with self._lock:
            opening, closing = self._to_open, self._to_close
            self._to_open, self._to_close = [], []
            for sid in closing:
                self.model.close(sid)
            failed = []
            for s in opening:
                if s.id in self.live:
                    try:
                        self.model.open(s.id, s.sampling)
                    except Exception:
                        logger.exception("duplex session %s failed to open", s.id)
                        failed.append(s)
            live = [s for s in self.live.values() if s.id in self.model.sessions]
        for s in failed:
            self._end(s, "error")
        return live

    def _frame(self, s: DuplexSession) -> torch.Tensor | None:
        raw = s.take(self.frame_bytes)
        if raw is None:
            return None
        return torch.frombuffer(bytearray(raw), dtype=torch.int16).float() / 32768.0

    def _count(self, latency_s: float, missed: bool, num: int) -> None:
        t = self.totals
        t.ticks += 1
        t.missed_ticks += num if missed else 0
        t.latency_sum_s += latency_s
        t.latency_count += 1
        for i, bound in enumerate(LATENCY_BUCKETS_S):
            if latency_s <= bound:
                t.latency_buckets[i] += 1

    def _emit(self, s: DuplexSession, out: TickOutput, frames: dict[str, torch.Tensor | None],
              latency_s: float, missed: bool) -> None:
        input_missed = out.heard and frames.get(s.id) is None
        st = s.stats
        tick = st.ticks
        st.ticks += 1        # first: a reader on another thread never sees more misses
        st.missed_ticks += missed
        st.missed_inputs += input_missed
        self.totals.missed_inputs += input_missed
        st.latencies_ms.append(latency_s * 1000)
        audio = None
        if out.audio is not None:
            audio = (out.audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes()
        ev = TickEvent(tick, out.text_id, out.text,
                       None if out.codes is None else out.codes.tolist(), audio, out.heard,
                       input_missed, round(latency_s * 1000, 3), missed)
        s.joined = True
        _deliver(s, ev, None)
        if out.finished:
            self._end(s, "max_length")

    def _end(self, s: DuplexSession, reason: str) -> None:
        with self._lock:
            self.live.pop(s.id, None)
        self.model.close(s.id)
        _deliver(s, None, reason)


def _deliver(s: DuplexSession, ev: TickEvent | None, reason: str | None) -> None:
    """Hand an event over; a receiver already gone (its event loop closed) misses it, and the
    ticker goes on for the other sessions."""
    try:
        s.deliver(ev, reason)
    except RuntimeError:
        logger.debug("duplex session %s: its receiver is gone", s.id)
