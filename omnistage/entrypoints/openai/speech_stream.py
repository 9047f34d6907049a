"""WebSocket /v1/audio/speech/stream: speech of a text that is still being written (an LLM's
answer piped in token by token). Every frame is a JSON text frame:

    client -> server
      {"type": "session.update", "session": {"voice": "alto", "response_format": "pcm", ...}}
                                     optional, before the first text (SpeechSession's fields)
      {"type": "input.append", "text": "Hello wor"}
      {"type": "input.flush"}        speak what is buffered now, boundary or not
      {"type": "input.done"}         no more text: speak the rest, then audio.done and close
      {"type": "cancel"}             abort every clause in flight, drop the buffered text;
                                     the session stays open for more text
    server -> client
      {"type": "session.updated", "session": {...}, "sample_rate": 24000}
      {"type": "audio.delta", "clause": 0, "audio": B64}   pieces of ONE file in the session's
                                     format (pcm: raw 16-bit mono), in text order
      {"type": "clause.done", "clause": 0, "text": "Hello world,"}
      {"type": "cancelled"}          the audio after it is a new file (wav, mp3...: a new header)
      {"type": "audio.done", "clauses": 3}    then the server closes the socket (1000)
      {"type": "error", "error": {OpenAI's error object}}   a bad message (the session goes
                                     on), or a clause that failed (then closed: 1008 for the
                                     client's fault, 1011 for the server's)

The text is buffered and cut into clauses (ClauseBuffer): at punctuation followed by a space
(or CJK punctuation), or at the last space before CLAUSE_MAX_CHARS. Each clause is submitted
as its own request as soon as it is cut, so the next one runs while the previous one's audio
still streams; one task sends their audio strictly in clause order. Closing the socket or
`cancel` closes every clause's handle, which aborts it in every stage.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
from typing import Any

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from omnistage.entrypoints.openai.client import RequestHandle, Ticket
from omnistage.entrypoints.openai.errors import APIError, bad_request, check_model, invalid
from omnistage.entrypoints.openai.json_body import parse_json
from omnistage.entrypoints.openai.protocol import SpeechSession
from omnistage.entrypoints.openai.serving_speech import ENCODING, SpeechServing
from omnistage.utils.audio import AudioEncoder

logger = logging.getLogger(__name__)
CLAUSE_MAX_CHARS = 200
# a clause ends at western punctuation followed by a space, or right after CJK punctuation
_BOUNDARY = re.compile(r"[.!?;:,\u2026]+[\"')\]]*\s+|[\u3002\uff01\uff1f\uff1b\uff1a\uff0c\u3001]+")
Clause = tuple[int, str, RequestHandle, Ticket]


class ClauseBuffer:
    """Text in as it comes; clauses out once their end is known."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.text = ""

    def append(self, text: str) -> list[str]:
        self.text += text
        return self._cut()

    def flush(self) -> list[str]:
        """The clauses, then whatever is left as one more."""
        clauses, rest = self._cut(), self.text.strip()
        self.text = ""
        return [*clauses, rest] if rest else clauses

    def _cut(self) -> list[str]:
        out = []
        while True:
            m = _BOUNDARY.search(self.text)
            if m is not None and m.end() <= self.max_chars:
                at = m.end()
            elif len(self.text) > self.max_chars:    # no boundary in reach: the last space
                space = self.text.rfind(" ", 0, self.max_chars)
                at = space + 1 if space > 0 else self.max_chars
            else:
                return out
            piece, self.text = self.text[:at].strip(), self.text[at:]
            if piece:
                out.append(piece)


class SpeechStream:
    """One WebSocket session (the module docstring's protocol)."""

    def __init__(self, ws: WebSocket, serving: SpeechServing, model_name: str) -> None:
        self.ws, self.serving, self.model_name = ws, serving, model_name
        self.session = SpeechSession()
        self.extra: dict[str, Any] | None = None      # resolved at the first clause
        self.buffer = ClauseBuffer(CLAUSE_MAX_CHARS)
        self.encoder: AudioEncoder | None = None
        self.num_clauses = 0
        self.done = False
        self.inflight: dict[int, Clause] = {}
        self.queue: asyncio.Queue[Clause | None] = asyncio.Queue()
        self.speaker: asyncio.Task[None] | None = None
        self._send_lock = asyncio.Lock()

    async def run(self) -> None:
        await self.ws.accept()
        try:
            spec = self.serving.require_speech()
        except APIError as err:
            await self._send({"type": "error", "error": err.body()["error"]})
            await self.ws.close(1008)
            return
        self.buffer.max_chars = min(CLAUSE_MAX_CHARS, spec.max_input_chars)
        self.speaker = asyncio.create_task(self._speak())
        try:
            await self._receive()
        finally:
            self._abort_all()
            self.speaker.cancel()
            await asyncio.gather(self.speaker, return_exceptions=True)

    # -- client messages -------------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            try:
                message = await self.ws.receive()
            except (WebSocketDisconnect, RuntimeError):   # closed, by either side
                return
            if message["type"] == "websocket.disconnect":
                return
            try:
                await self._handle(message.get("text"))
            except APIError as err:
                if err.status >= 500 or err.status == 429:
                    await self._fail(err)
                    return
                await self._send({"type": "error", "error": err.body()["error"]})

    async def _handle(self, raw: str | None) -> None:
        msg = parse_json(raw) if raw is not None else None    # None: a binary frame
        if not isinstance(msg, dict):
            raise bad_request("a message must be a JSON object with a type", code="invalid_json")
        kind = msg.get("type")
        if self.done and kind != "cancel":
            raise bad_request(f"{kind}: the input is done; open a new session", "type")
        if kind == "session.update":
            await self._configure(msg.get("session"))
        elif kind == "input.append":
            text = msg.get("text")
            if not isinstance(text, str):
                raise bad_request("text: input.append needs a string", "text")
            await self._submit(self.buffer.append(text))
        elif kind in ("input.flush", "input.done"):
            await self._submit(self.buffer.flush())
            if kind == "input.done":
                self.done = True
                self.queue.put_nowait(None)
        elif kind == "cancel":
            await self._cancel()
        else:
            raise bad_request(f"type: {kind!r} is not a message type (session.update, "
                              "input.append, input.flush, input.done, cancel)", "type")

    async def _configure(self, body: object) -> None:
        if self.num_clauses or self.buffer.text:
            raise bad_request("session.update: only before the first text", "type")
        try:
            session = SpeechSession.model_validate(body if isinstance(body, dict) else {})
        except ValidationError as exc:
            err = invalid(list(exc.errors()))
            err.param = f"session.{err.param}" if err.param else "session"
            raise err from None
        check_model(session.model, self.model_name)
        self.serving.check_speed(session.speed, "session.speed")
        self.extra = await self.serving.extra(session, "session.")
        self.session = session
        await self._send({"type": "session.updated",
                          "session": session.model_dump(exclude={"ref_audio"}),
                          "sample_rate": self.serving.client.engine.audio_sample_rate})

    async def _voice(self) -> dict[str, Any]:
        """Who speaks: resolved once, by the session's update or at the first clause."""
        if self.extra is None:
            self.extra = await self.serving.extra(self.session, "session.")
        return self.extra

    async def _submit(self, clauses: list[str]) -> None:
        """Each clause a request, now, in order."""
        for text in clauses:
            handle, ticket = await self.serving.start(text, self._voice, "text")
            clause = (self.num_clauses, text, handle, ticket)
            self.inflight[self.num_clauses] = clause
            self.num_clauses += 1
            self.queue.put_nowait(clause)

    async def _cancel(self) -> None:
        """Abort what runs, drop the buffer, and start a fresh speaker (the old one may wait on
        an aborted request)."""
        assert self.speaker is not None
        self.speaker.cancel()
        await asyncio.gather(self.speaker, return_exceptions=True)
        self._abort_all()
        self.buffer.text = ""
        self.encoder = None    # the file cut short is dropped: audio after this starts a new one
        self.queue = asyncio.Queue()
        if self.done:          # nothing more will come: end the session as input.done would
            self.queue.put_nowait(None)
        self.speaker = asyncio.create_task(self._speak())
        await self._send({"type": "cancelled"})

    # -- audio out -------------------------------------------------------------------------------
    async def _speak(self) -> None:
        """Clause after clause, in order, each one's audio as it comes."""
        try:
            while (clause := await self.queue.get()) is not None:
                idx, text, handle, _ = clause
                async for wave, rate in self.serving.waves(handle):
                    if self.encoder is None:
                        self.encoder = AudioEncoder(ENCODING[self.session.response_format], rate)
                    await self._audio(idx, await run_in_threadpool(self.encoder.encode, wave))
                self._close(idx)
                await self._send({"type": "clause.done", "clause": idx, "text": text})
            if self.encoder is not None:
                await self._audio(self.num_clauses - 1,
                                  await run_in_threadpool(self.encoder.close))
            await self._send({"type": "audio.done", "clauses": self.num_clauses})
            await self.ws.close(1000)
        except APIError as err:
            await self._fail(err)
        except (WebSocketDisconnect, RuntimeError):   # the client went: _receive ends it all
            pass

    async def _audio(self, idx: int, data: bytes) -> None:
        if data:
            await self._send({"type": "audio.delta", "clause": idx,
                              "audio": base64.b64encode(data).decode("ascii")})

    async def _fail(self, err: APIError) -> None:
        self._abort_all()
        try:
            await self._send({"type": "error", "error": err.body()["error"]})
            await self.ws.close(1011 if err.status >= 500 else 1008)
        except (WebSocketDisconnect, RuntimeError):
            pass

    async def _send(self, event: dict[str, Any]) -> None:
        if self.ws.application_state != WebSocketState.CONNECTED:
            return
        async with self._send_lock:    # the receiver's errors and the speaker's audio
            await self.ws.send_text(json.dumps(event, separators=(",", ":")))

    def _close(self, idx: int) -> None:
        clause = self.inflight.pop(idx, None)
        if clause is not None:
            clause[2].close()
            clause[3].release()

    def _abort_all(self) -> None:
        """Close every clause's handle: an unfinished one is aborted in every stage."""
        for idx in list(self.inflight):
            self._close(idx)
