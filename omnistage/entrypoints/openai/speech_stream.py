"""WebSocket /v1/audio/speech/stream: speech of a text that is still being written (an LLM's
answer piped in token by token). Every frame is a JSON text frame:

    client -> server
      {"type": "session.update", "session": {"voice": "alto", "response_format": "pcm", ...}}
                                     optional, before the first text (SpeechSession's fields;
                                     a multi-speaker model's `voices`: speech_stream_script.py)
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

The text is buffered and cut into clauses (clauses.py, in time linear in the text): at
punctuation followed by a space (or CJK punctuation), or at the last space before
CLAUSE_MAX_CHARS. Each clause is its own request, submitted as soon as it is cut while the
session holds fewer than MAX_CLAUSES_IN_FLIGHT admitted (the server's --max-queue is shared
by every client: one socket never takes more than its share); the others wait in the session
and go in, in order, as clauses finish. So the next clause runs while the previous one's audio
still streams, and one task sends their audio strictly in clause order. Closing the socket or
`cancel` closes every clause's handle, which aborts it in every stage.

Limits, each refused with an `error` event (400; the append is dropped whole, the session
goes on): one input.append carries at most MAX_APPEND_CHARS characters (`text_too_long`), and
a session holds at most MAX_PENDING_CHARS characters not yet spoken, buffered, waiting or
being spoken (`input_text_buffer_full`: send more once clause.done events come).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections import deque
from typing import Any, Awaitable, Callable

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from omnistage.entrypoints.openai.clauses import ClauseBuffer
from omnistage.entrypoints.openai.client import RequestHandle
from omnistage.entrypoints.openai.errors import APIError, bad_request, check_model, invalid
from omnistage.entrypoints.openai.json_body import parse_json
from omnistage.entrypoints.openai.protocol_speech import SpeechSession
from omnistage.entrypoints.openai.serving_speech import ENCODING, SpeechServing
from omnistage.entrypoints.openai.speech_stream_script import ScriptClauses
from omnistage.entrypoints.openai.speech_stream_vllm import VllmSpeechStream, is_vllm_first
from omnistage.utils.audio import AudioEncoder

logger = logging.getLogger(__name__)
CLAUSE_MAX_CHARS = 200
MAX_CLAUSES_IN_FLIGHT = 4          # one session's share of the server's queue (--max-queue)
MAX_APPEND_CHARS = 16_384          # one input.append's text
MAX_PENDING_CHARS = 65_536         # a session's text not yet spoken
Clause = tuple[int, str, RequestHandle]


class SpeechStream:
    """One WebSocket session (the module docstring's protocol)."""

    def __init__(self, ws: WebSocket, serving: SpeechServing, model_name: str) -> None:
        self.ws, self.serving, self.model_name = ws, serving, model_name
        self.session = SpeechSession()
        self.extra: dict[str, Any] | None = None      # resolved at the first clause
        self.script: ScriptClauses | None = None      # a multi-speaker model's speakers
        self.buffer = ClauseBuffer(CLAUSE_MAX_CHARS)
        self.encoder: AudioEncoder | None = None
        self.num_clauses = 0
        self.done = False            # input.done came: nothing more will be cut
        self.ended = False           # and the speaker was told (None on its queue)
        self.waiting: deque[str] = deque()   # clauses cut, not yet submitted (over the share)
        self.num_waiting_chars = 0
        self.inflight: dict[int, Clause] = {}
        self.queue: asyncio.Queue[Clause | None] = asyncio.Queue()
        self._submitting = asyncio.Lock()    # the receiver's and the speaker's submissions
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
        self.script = ScriptClauses() if spec.speakers > 1 else None
        first = await self._first()
        if first is None:
            return
        if is_vllm_first(first[1]):        # vLLM-Omni's dialect (speech_stream_vllm.py)
            await VllmSpeechStream(self.ws, self.serving, self.model_name,
                                   self.buffer.max_chars).run(first[1])
            return
        self.speaker = asyncio.create_task(self._speak())
        try:
            if await self._dispatch(first[0]):
                await self._receive()
        finally:
            self._abort_all()
            self.speaker.cancel()
            await asyncio.gather(self.speaker, return_exceptions=True)

    # -- client messages -------------------------------------------------------------------------
    async def _first(self) -> tuple[str | None, object] | None:
        """The first message (its text and its JSON, which picks the dialect); None: gone."""
        try:
            message = await self.ws.receive()
        except (WebSocketDisconnect, RuntimeError):
            return None
        if message["type"] == "websocket.disconnect":
            return None
        raw = message.get("text")
        try:
            return raw, json.loads(raw) if raw is not None else None
        except ValueError:
            return raw, None

    async def _dispatch(self, raw: str | None) -> bool:
        """One message handled; False once the session failed."""
        try:
            await self._handle(raw)
        except APIError as err:
            if err.status >= 500 or err.status == 429:
                await self._fail(err)
                return False
            await self._send({"type": "error", "error": err.body()["error"]})
        return True

    async def _receive(self) -> None:
        while True:
            try:
                message = await self.ws.receive()
            except (WebSocketDisconnect, RuntimeError):   # closed, by either side
                return
            if message["type"] == "websocket.disconnect":
                return
            if not await self._dispatch(message.get("text")):
                return

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
            self._check_room(text)
            self._wait(self.buffer.append(text))
            await self._submit()
        elif kind in ("input.flush", "input.done"):
            self._wait(self.buffer.flush())
            if kind == "input.done":
                self.done = True
            await self._submit()
        elif kind == "cancel":
            await self._cancel()
        else:
            raise bad_request(f"type: {kind!r} is not a message type (session.update, "
                              "input.append, input.flush, input.done, cancel)", "type")

    async def _configure(self, body: object) -> None:
        if self.num_clauses or self.buffer.text or self.waiting:
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
                          "session": session.model_dump(exclude={"ref_audio", "voices"}),
                          "sample_rate": self.serving.client.engine.audio_sample_rate})

    async def _voice(self) -> dict[str, Any]:
        """Who speaks: resolved once, by the session's update or at the first clause."""
        if self.extra is None:
            self.extra = await self.serving.extra(self.session, "session.")
        return self.extra

    def _clause_voice(self, text: str) -> Callable[[], Awaitable[dict[str, Any]]]:
        """Who speaks one clause: the session's voice (a script's clause: its speakers')."""
        async def voice() -> dict[str, Any]:
            extra = await self._voice()
            return extra if self.script is None else \
                self.script.extra(extra, text, "session.voices")
        return voice

    def _check_room(self, text: str) -> None:
        """The limits on one append and on the text not yet spoken (the module docstring)."""
        if len(text) > MAX_APPEND_CHARS:
            raise bad_request(f"text: one input.append carries at most {MAX_APPEND_CHARS} "
                              f"characters; this one has {len(text)} (send it in pieces)",
                              "text", "text_too_long")
        pending = len(self.buffer) + self.num_waiting_chars \
            + sum(len(c[1]) for c in self.inflight.values())
        if pending + len(text) > MAX_PENDING_CHARS:
            raise bad_request(f"text: the session holds {pending} characters not yet spoken; "
                              f"{len(text)} more would pass its limit of {MAX_PENDING_CHARS} "
                              "(send more once clause.done events come)", "text",
                              "input_text_buffer_full")

    def _wait(self, clauses: list[str]) -> None:
        if self.script is not None:      # each clause says who speaks it
            clauses = self.script.clauses(clauses)
        self.waiting.extend(clauses)
        self.num_waiting_chars += sum(map(len, clauses))

    async def _submit(self) -> None:
        """Waiting clauses become requests, in order, while the session holds fewer than
        MAX_CLAUSES_IN_FLIGHT; once input.done came and none waits, the speaker is told. A
        clause the server refuses as the client's fault is dropped with an error event;
        a 429 or 5xx is raised (it ends the session)."""
        async with self._submitting:
            while self.waiting and len(self.inflight) < MAX_CLAUSES_IN_FLIGHT:
                text = self.waiting.popleft()
                self.num_waiting_chars -= len(text)
                try:
                    handle = await self.serving.start(
                        text, self._clause_voice(text), "text",
                        ("session.max_new_tokens", self.session.max_new_tokens))
                except APIError as err:
                    if err.status >= 500 or err.status == 429:
                        raise
                    await self._send({"type": "error", "error": err.body()["error"]})
                    continue
                clause = (self.num_clauses, text, handle)
                self.inflight[self.num_clauses] = clause
                self.num_clauses += 1
                self.queue.put_nowait(clause)
            if self.done and not self.waiting and not self.ended:
                self.ended = True
                self.queue.put_nowait(None)

    async def _cancel(self) -> None:
        """Abort what runs, drop the buffer, and start a fresh speaker (the old one may wait on
        an aborted request)."""
        assert self.speaker is not None
        self.speaker.cancel()
        await asyncio.gather(self.speaker, return_exceptions=True)
        self._abort_all()
        self.buffer.clear()
        self.waiting.clear()
        self.num_waiting_chars = 0
        self.encoder = None    # the file cut short is dropped: audio after this starts a new one
        self.queue = asyncio.Queue()
        self.ended = self.done
        if self.done:          # nothing more will come: end the session as input.done would
            self.queue.put_nowait(None)
        self.speaker = asyncio.create_task(self._speak())
        await self._send({"type": "cancelled"})

    # -- audio out -------------------------------------------------------------------------------
    async def _speak(self) -> None:
        """Clause after clause, in order, each one's audio as it comes."""
        try:
            while (clause := await self.queue.get()) is not None:
                idx, text, handle = clause
                async for wave, rate in self.serving.waves(handle):
                    if self.encoder is None:
                        self.encoder = AudioEncoder(ENCODING[self.session.response_format], rate)
                    await self._audio(idx, await run_in_threadpool(self.encoder.encode, wave))
                self._close(idx)
                await self._submit()          # its slot to the next waiting clause
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
            clause[2].close()      # aborted if unfinished; its slot freed

    def _abort_all(self) -> None:
        """Close every clause's handle: an unfinished one is aborted in every stage."""
        for idx in list(self.inflight):
            self._close(idx)
