"""Resumable realtime sessions: a dropped WebSocket reconnects to its session, within a grace
period, with its conversation, its input audio and the answer it was hearing intact. The
protocol is vLLM-Omni's for its duplex sessions (`session.resume`, `server_event_seq`,
`session.event_ack`, `session.resumed`), on OpenAI's realtime session:

    client                                             server
    GET /v1/realtime?model=M[&resume_grace_s=G]   ->   session.created {session: {id}, resume_token}
                                                  <-   every later event: its server_event_seq
    session.event_ack {server_event_seq: n}       ->   (events up to n leave the journal)
    ... the socket drops: no close frame, or any close code but 1000 ...
        the session waits G seconds (the server's RealtimeLimits.resume_grace_s at most, 30 s,
        and by default); its response runs on and its events are journaled
    GET /v1/realtime?resume=1                     ->
    session.resume {session_id, resume_token,
                    last_received_server_event_seq}
                                                  <-   session.resumed {session, resume_token
                                                       (a new one)}, then each journaled event
                                                       after that seq, in order; then live

A session not resumed in its grace period ends (its response aborted in every stage) and is
freed. A socket closed with 1000 (or the server's idle timeout) ends its session at once, as
before. A second socket for a session whose socket is still attached is refused
(`session_resume_conflict`): one socket per session, and the server notices a socket that
died without closing by its pings (uvicorn: within about 40 s). The journal keeps the newest
`resume_journal_bytes` of events not acknowledged; a resume from before them is refused with
vLLM-Omni's `session.resync_required`, and the session ends.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
from collections import deque
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field
from starlette.websockets import WebSocket, WebSocketDisconnect

from omnistage.entrypoints.openai.errors import APIError, bad_request
from omnistage.entrypoints.openai.realtime.protocol import client_event, error_event, event, parse

FIRST_EVENT_WAIT_S = 10.0
KEEP_SESSION = frozenset({1000, 1012})    # a clean close, or the server's own restart: no resume


class SessionResume(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["session.resume"]
    event_id: str | None = None
    session_id: str
    resume_token: str
    last_received_server_event_seq: int = Field(0, ge=0)
    incarnation: int | None = None                 # vLLM-Omni's; one incarnation here


class Journal:
    """The session's server events, numbered, the newest `max_bytes` of them kept (less what
    the client acknowledged) for a resume to replay."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: deque[tuple[int, str]] = deque()   # (server_event_seq, the event's JSON)
        self.num_bytes = 0
        self.last_seq = 0
        self.dropped_through = 0                         # events up to here are gone

    def record(self, ev: dict[str, Any]) -> str:
        self.last_seq += 1
        text = json.dumps({**ev, "server_event_seq": self.last_seq}, separators=(",", ":"))
        self.entries.append((self.last_seq, text))
        self.num_bytes += len(text)
        while self.num_bytes > self.max_bytes:
            self._pop()
        return text

    def acknowledge(self, seq: object) -> None:
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq <= self.last_seq:
            raise bad_request(f"server_event_seq={seq!r}: an integer from 0 to the last event's "
                              f"({self.last_seq}) is required", "server_event_seq",
                              "invalid_event_ack")
        while self.entries and self.entries[0][0] <= seq:
            self._pop()
        self.dropped_through = max(self.dropped_through, seq)

    def after(self, seq: int) -> list[str] | None:
        """The events after `seq`, oldest first; None when some of them are gone (or `seq` is
        ahead of the last event)."""
        if seq < self.dropped_through or seq > self.last_seq:
            return None
        return [text for s, text in self.entries if s > seq]

    def _pop(self) -> None:
        seq, text = self.entries.popleft()
        self.num_bytes -= len(text)
        self.dropped_through = seq


class Resumable(Protocol):
    """What this module asks of a session (connection.py's RealtimeConnection)."""
    attached: bool
    resume_token: str | None
    journal: Journal | None

    async def reattach(self, ws: WebSocket, missed: list[str]) -> None: ...

    async def end(self, reason: str) -> None: ...


class ResumableSocket:
    """The resume half of a session's connection (the realtime and the duplex ones): the
    grace period's timer and the new socket's take-over. The class sets `attached`,
    `resume_token`, `ws`, `_grace` (the timer task or None) and `_send_lock`, and has
    `_session_json()`, `_serve()` and `end(reason)`."""

    async def _expire(self, grace_s: float) -> None:
        await asyncio.sleep(grace_s)
        await self.end("session_expired")

    async def reattach(self, ws: WebSocket, missed: list[str]) -> None:
        """A new socket for this waiting session: session.resumed, the events it missed,
        then on as before."""
        if self._grace is not None:
            self._grace.cancel()
        self.attached = True
        async with self._send_lock:         # no live event slips in before the missed ones
            self.ws, self.resume_token = ws, new_token()
            try:
                await ws.send_text(json.dumps(event(
                    "session.resumed", session=self._session_json(),
                    resume_token=self.resume_token), separators=(",", ":")))
                for text in missed:
                    await ws.send_text(text)
            except (WebSocketDisconnect, RuntimeError):
                pass                        # gone again: the connection's loop sees it
        await self._serve()


class Sessions:
    """The server's live realtime sessions by id: attached to a socket, or waiting for one."""

    def __init__(self) -> None:
        self.live: dict[str, Resumable] = {}

    def __len__(self) -> int:
        return len(self.live)

    def add(self, session_id: str, conn: Resumable) -> None:
        assert session_id not in self.live, session_id
        self.live[session_id] = conn

    def remove(self, session_id: str, conn: Resumable) -> None:
        if self.live.get(session_id) is conn:
            del self.live[session_id]


def new_token() -> str:
    return "rt_" + secrets.token_urlsafe(24)


def grace_of(query: Any, limit_s: float) -> float:
    """The session's grace period: `resume_grace_s` of the query (0: none), at most the
    server's limit, which is the default."""
    raw = query.get("resume_grace_s")
    if raw is None:
        return limit_s
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= limit_s:
        raise bad_request(f"resume_grace_s={raw!r}: seconds from 0 to the server's limit of "
                          f"{limit_s:g}", "resume_grace_s")
    return value


def is_resume(ws: WebSocket) -> bool:
    return ws.query_params.get("resume") in ("1", "true")


async def resume(ws: WebSocket, sessions: Sessions) -> None:
    """A socket opened with ?resume=1: its first event names the session to take over."""
    await ws.accept()
    try:
        message = await asyncio.wait_for(ws.receive(), FIRST_EVENT_WAIT_S)
        if message["type"] == "websocket.disconnect":
            return
        request: SessionResume = parse(SessionResume, client_event(message.get("text")),
                                       "session.resume")
        conn = sessions.live.get(request.session_id)
        if conn is None:
            raise APIError(404, f"session_id: no session {request.session_id!r} to resume (it "
                                "ended, its grace period passed, or it never was)",
                           param="session_id", code="session_resume_expired")
        if conn.resume_token is None or not hmac.compare_digest(
                conn.resume_token.encode(), request.resume_token.encode()):
            raise APIError(401, "resume_token: not this session's current token",
                           param="resume_token", code="invalid_resume_token")
        if conn.attached:
            raise APIError(409, f"session {request.session_id!r} is attached to another "
                                "socket; a session takes one at a time (close that one, or "
                                "wait until the server notices that it dropped)",
                           param="session_id", code="session_resume_conflict")
        missed = conn.journal.after(request.last_received_server_event_seq) \
            if conn.journal is not None else None
        if missed is None:
            await ws.send_text(json.dumps(event("session.resync_required",
                                                session_id=request.session_id,
                                                reason="journal_gap")))
            await ws.close(1008)
            await conn.end("resync_required")
            return
    except TimeoutError:
        await _refuse(ws, bad_request(f"no session.resume within {FIRST_EVENT_WAIT_S:g} s",
                                      None, "session_resume_timeout"))
        return
    except APIError as err:
        await _refuse(ws, err)
        return
    await conn.reattach(ws, missed)


async def _refuse(ws: WebSocket, err: APIError) -> None:
    await ws.send_text(json.dumps(error_event(err)))
    await ws.close(1008)
