"""One /v1/duplex session (protocol.py has the events): a slot of the duplex runtime
(engine/duplex.py) joined to a WebSocket.

    socket ─ receive loop ─ append / clear / update / ack / close ─> runtime session inbox
    runtime ticker thread ─ TickEvent ─ call_soon_threadsafe ─> outbox ─ pump task ─> socket
                                                                   └─> journal (resume.py)

Input and output run at once: the receive loop never waits for the model, the pump sends
each tick's events as they come. The socket closing with 1000 (or the client's
`session.close`) ends the session and frees its slot at once; a socket that drops otherwise
leaves the session ticking (hearing silence, its events journaled) for its grace period, in
which `?resume=1` + `session.resume` takes it back (realtime/resume.py, vLLM-Omni's resume
protocol) with the events it missed; after it, the session ends. A session the runtime ends
(the model's context used up, a failure, shutdown) sends `session.ended` and closes 1000.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from omnistage.engine.duplex import DuplexRuntime, DuplexSession, SessionsFull, TickEvent
from omnistage.entrypoints.openai.duplex.protocol import (MAX_EVENT_BYTES, check_type, sampling_of,
                                                          check_update, decode_audio,
                                                          session_json)
from omnistage.entrypoints.openai.errors import APIError, check_model
from omnistage.entrypoints.openai.realtime.protocol import (client_event, error_event, event,
                                                            event_id_of, new_id)
from omnistage.entrypoints.openai.realtime.resume import (KEEP_SESSION, Journal,
                                                          ResumableSocket, Sessions,
                                                          grace_of, new_token)

logger = logging.getLogger(__name__)
JOURNAL_BYTES = 8 << 20              # 30 s of events at 24 kHz is about 2.6 MB


class DuplexConnection(ResumableSocket):
    def __init__(self, ws: WebSocket, runtime: DuplexRuntime, model_name: str,
                 sessions: Sessions, resume_grace_s: float, max_chunk_bytes: int) -> None:
        self.ws, self.runtime, self.model_name = ws, runtime, model_name
        self.sessions, self.grace_limit_s = sessions, resume_grace_s
        self.max_chunk_bytes = max_chunk_bytes
        self.session: DuplexSession | None = None
        self.session_id = ""
        self.response_id = new_id("resp")
        self.attached = False
        self.resume_token: str | None = None
        self.journal: Journal | None = None
        self.outbox: asyncio.Queue[tuple[TickEvent | None, str | None]] = asyncio.Queue()
        self._send_lock = asyncio.Lock()
        self._pump: asyncio.Task[None] | None = None
        self._grace: asyncio.Task[None] | None = None
        self._grace_s = 0.0
        self._ended = False

    async def run(self) -> None:
        await self.ws.accept()
        loop = asyncio.get_running_loop()
        try:
            check_model(self.ws.query_params.get("model"), self.model_name)
            self._grace_s = grace_of(self.ws.query_params, self.grace_limit_s)
            sampling = sampling_of(self.ws.query_params)
            self.session = self.runtime.open(
                lambda ev, reason: loop.call_soon_threadsafe(self.outbox.put_nowait,
                                                             (ev, reason)), sampling)
        except SessionsFull as exc:
            await self._refuse(APIError(429, str(exc), code="session_limit_reached"), 1013)
            return
        except APIError as err:
            await self._refuse(err, 1008)
            return
        self.session_id = self.session.id
        extra: dict[str, Any] = {}
        if self._grace_s > 0:
            self.resume_token = new_token()
            self.journal = Journal(JOURNAL_BYTES)
            extra = {"resume_token": self.resume_token}
        self.sessions.add(self.session_id, self)
        self.attached = True
        await self._send(event("session.created", session=self._session_json(), **extra))
        await self._send(event("response.created", response={
            "id": self.response_id, "object": "realtime.response", "status": "in_progress",
            "output_modalities": ["audio"]}))
        self._pump = asyncio.create_task(self._pump_events())
        await self._serve()

    def _session_json(self) -> dict[str, Any]:
        m = self.runtime.model
        return session_json(self.session_id, self.model_name, m.sample_rate, m.frame_size,
                            self.runtime.tick_s * 1000, m.max_frames)

    async def _refuse(self, err: APIError, code: int) -> None:
        await self.ws.send_text(json.dumps(error_event(err)))
        await self.ws.close(code)

    # -- the socket's life (resume.py) -------------------------------------------------------
    async def _serve(self) -> None:
        self.attached, dropped = True, False
        try:
            dropped = await self._receive()
        finally:
            self.attached = False
            if not self._ended and dropped and self.journal is not None:
                self._grace = asyncio.create_task(self._expire(self._grace_s))
            elif not self._ended:
                await self.end("client_disconnected")

    async def end(self, reason: str, notify: bool = False) -> None:
        """The session is over: its slot freed; with `notify`, the final event sent and the
        socket closed."""
        if self._ended:
            return
        self._ended = True
        self.sessions.remove(self.session_id, self)
        if self.session is not None:
            self.runtime.close(self.session)
        if self._pump is not None and self._pump is not asyncio.current_task():
            self._pump.cancel()
        if notify and self.attached and self.session is not None:
            await self._send(event("session.ended", session_id=self.session_id, reason=reason,
                                   stats=self.session.stats.summary()))
            try:
                await self.ws.close(1000)
            except RuntimeError:
                pass
        self.journal, self.resume_token = None, None

    # -- in and out --------------------------------------------------------------------------
    async def _receive(self) -> bool:
        """The socket's events until it goes; whether it dropped (a resume may follow)."""
        while not self._ended:
            try:
                message = await self.ws.receive()
            except WebSocketDisconnect as exc:
                return exc.code not in KEEP_SESSION
            except RuntimeError:
                return False
            if message["type"] == "websocket.disconnect":
                return message.get("code", 1000) not in KEEP_SESSION
            raw, msg = message.get("text"), None
            try:
                if raw is not None and len(raw) > MAX_EVENT_BYTES:
                    raise APIError(400, f"an event is at most {MAX_EVENT_BYTES} bytes",
                                   code="event_too_large")
                msg = client_event(raw)
                await self._handle(msg)
            except APIError as err:
                await self._send(error_event(err, None if raw is not None and len(raw) >
                                             MAX_EVENT_BYTES else event_id_of(msg, raw)))
            except Exception:
                logger.exception("duplex event failed")
                await self._send(error_event(APIError(500, "the server failed to handle the "
                                                           "event", code="internal_error")))
        return False

    async def _handle(self, msg: dict[str, Any]) -> None:
        assert self.session is not None
        kind = check_type(msg)
        if kind == "input_audio_buffer.append":
            pcm = decode_audio(msg, self.max_chunk_bytes)
            try:
                self.session.append(pcm)
            except ValueError as exc:
                raise APIError(400, str(exc), param="audio",
                               code="input_audio_buffer_full") from None
        elif kind == "input_audio_buffer.clear":
            self.session.clear()
            await self._send(event("input_audio_buffer.cleared"))
        elif kind == "session.update":
            check_update(msg, self.runtime.model.sample_rate, self.model_name)
            await self._send(event("session.updated", session=self._session_json()))
        elif kind == "session.event_ack":
            if self.journal is not None:
                self.journal.acknowledge(msg.get("server_event_seq"))
        else:                                # session.close
            await self.end("client_closed", notify=True)

    async def _pump_events(self) -> None:
        while True:
            ev, reason = await self.outbox.get()
            if ev is None:
                await self.end(reason or "ended", notify=True)
                return
            await self._send_tick(ev)

    async def _send_tick(self, ev: TickEvent) -> None:
        await self._send(event("response.output_audio_transcript.delta",
                               response_id=self.response_id, delta=ev.text,
                               token_id=ev.text_id, tick=ev.tick, heard=ev.heard,
                               input_missed=ev.input_missed))
        if ev.audio is not None:
            await self._send(event("response.output_audio.delta", response_id=self.response_id,
                                   delta=base64.b64encode(ev.audio).decode(), tick=ev.tick,
                                   codes=ev.codes, latency_ms=ev.latency_ms,
                                   missed_tick=ev.missed))

    async def _send(self, ev: dict[str, Any]) -> None:
        async with self._send_lock:
            text = (self.journal.record(ev) if self.journal is not None
                    else json.dumps(ev, separators=(",", ":")))
            if not self.attached:
                return
            try:
                await self.ws.send_text(text)
            except (WebSocketDisconnect, RuntimeError):
                pass                         # gone: the receive loop sees it
