"""WebSocket /v1/audio/speech/stream in vLLM-Omni's dialect, chosen by the client's first
message being `session.config` (speech_stream.py keeps OpenAI-style events otherwise).

    client -> server
      {"type": "session.config", "voice": "alto", "response_format": "wav", ...}   first
      {"type": "input.text", "text": "Hello wor"}
      {"type": "input.done"}
    server -> client, per sentence, in order
      {"type": "audio.start", "sentence_index": 0, "sentence_text": "Hello world."}
      binary frames: the sentence's audio, one whole file in the session's format
                     (wav by default; raw 16-bit mono pcm when stream_audio is true)
      {"type": "audio.done", "sentence_index": 0, "total_bytes": N}   (+ "error" if it failed)
    then {"type": "session.done", "total_sentences": K} and the server closes the socket (1000);
    a bad message: {"type": "error", "message": "..."} (the session goes on).

Session fields: model, voice, language, instructions, ref_audio, ref_text, response_format,
speed (1.0 only), stream_audio, and vLLM-Omni's task_type, x_vector_only_mode (true: a clone
from the speaker embedding alone, its transcript dropped) and max_new_tokens (caps each
sentence's talker frames), read as on /v1/audio/speech (speech_task.py); a bad value is an
error event naming the field. Sentences are cut as text
arrives by clauses.py (so at commas too), each its own request; the next sentence is submitted
while the previous one's audio streams (at most SENTENCES_AHEAD queued).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from omnistage.entrypoints.openai.clauses import ClauseBuffer
from omnistage.entrypoints.openai.client import RequestHandle
from omnistage.entrypoints.openai.errors import APIError, bad_request, check_model
from omnistage.entrypoints.openai.protocol_speech import SpeechSession
from omnistage.entrypoints.openai.serving_speech import ENCODING, SpeechServing
from omnistage.entrypoints.openai.speech_stream_script import ScriptClauses
from omnistage.entrypoints.openai.speech_task import check_max_new_tokens
from omnistage.utils.audio import AudioEncoder

SENTENCES_AHEAD = 2
MAX_TEXT_CHARS = 16_384            # one input.text
OURS = ("model", "voice", "language", "instructions", "ref_audio", "ref_text", "speed",
        "task_type", "x_vector_only_mode", "voices")


def is_vllm_first(msg: object) -> bool:
    return isinstance(msg, dict) and msg.get("type") == "session.config"


def session_of(msg: dict[str, Any]) -> tuple[SpeechSession, str, int | None]:
    """The session, its audio format and its `max_new_tokens` from a session.config; APIError
    naming a field we cannot honour (task_type and x_vector_only_mode are read as on
    /v1/audio/speech, by speech_task.py, when the voice is resolved)."""
    body = {k: v for k, v in msg.items() if k != "type"}
    max_new_tokens = check_max_new_tokens(body.pop("max_new_tokens", None))
    stream_audio = body.pop("stream_audio", False)
    if not isinstance(stream_audio, bool):
        raise bad_request("stream_audio: must be true or false", "stream_audio")
    fmt = body.pop("response_format", "wav")
    unknown = sorted(set(body) - set(OURS))
    if unknown:
        raise bad_request(f"{unknown[0]}: not a session.config field", unknown[0])
    try:
        session = SpeechSession.model_validate({**body, "response_format": fmt})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "session"
        raise bad_request(f"{field}: {first['msg']}", field) from None
    return session, "pcm" if stream_audio else session.response_format, max_new_tokens


class VllmSpeechStream:
    """One session in vLLM-Omni's dialect (the module docstring)."""

    def __init__(self, ws: WebSocket, serving: SpeechServing, model_name: str,
                 max_chars: int) -> None:
        self.ws, self.serving, self.model_name = ws, serving, model_name
        self.buffer = ClauseBuffer(max_chars)
        self.session, self.fmt = SpeechSession(), "wav"
        self.max_new_tokens: int | None = None
        self.extra: dict[str, Any] | None = None
        spec = serving.spec
        self.script = ScriptClauses() if spec is not None and spec.speakers > 1 else None
        self.queue: asyncio.Queue[tuple[int, str, RequestHandle] | None] = \
            asyncio.Queue(SENTENCES_AHEAD)
        self.num_sentences = 0
        self.done = False
        self.handles: list[RequestHandle] = []
        self._send_lock = asyncio.Lock()     # the receiver's errors and the speaker's audio

    async def run(self, first: dict[str, Any]) -> None:
        try:
            await self._configure(first)
        except APIError as err:
            await self._send({"type": "error", "message": err.message})
            await self.ws.close(1008)
            return
        speaker = asyncio.create_task(self._speak())
        receiver = asyncio.create_task(self._receive())
        try:
            await asyncio.wait([speaker, receiver], return_when=asyncio.FIRST_COMPLETED)
            if receiver.done() and self.done:
                await speaker
        finally:
            for task in (speaker, receiver):
                task.cancel()
            await asyncio.gather(speaker, receiver, return_exceptions=True)
            for handle in self.handles:
                handle.close()

    async def _configure(self, msg: dict[str, Any]) -> None:
        self.session, self.fmt, self.max_new_tokens = session_of(msg)
        check_model(self.session.model, self.model_name)
        self.serving.check_speed(self.session.speed)
        self.extra = await self.serving.extra(self.session)

    def _voice(self, text: str) -> Callable[[], Awaitable[dict[str, Any]]]:
        """Who speaks one sentence: the session's voice (a script's: its speakers')."""
        async def voice() -> dict[str, Any]:
            assert self.extra is not None
            return self.extra if self.script is None else \
                self.script.extra(self.extra, text)
        return voice

    async def _receive(self) -> None:
        while not self.done:
            try:
                message = await self.ws.receive()
            except (WebSocketDisconnect, RuntimeError):
                return
            if message["type"] == "websocket.disconnect":
                return
            try:
                await self._handle(message.get("text"))
            except APIError as err:
                await self._send({"type": "error", "message": err.message})
                if err.status >= 500 or err.status == 429:
                    return

    async def _handle(self, raw: str | None) -> None:
        try:
            msg = json.loads(raw) if raw is not None else None
        except ValueError:
            msg = None
        if not isinstance(msg, dict):
            raise bad_request("a message must be a JSON object with a type")
        kind = msg.get("type")
        if kind == "input.text":
            text = msg.get("text")
            if not isinstance(text, str) or len(text) > MAX_TEXT_CHARS:
                raise bad_request(f"input.text: text must be a string of at most "
                                  f"{MAX_TEXT_CHARS} characters")
            await self._submit(self.buffer.append(text))
        elif kind == "input.done":
            await self._submit(self.buffer.flush())
            self.done = True
            await self.queue.put(None)
        elif kind == "session.config":
            raise bad_request("session.config: only as the first message")
        else:
            raise bad_request(f"type: {kind!r} is not a message type (session.config, "
                              "input.text, input.done)")

    async def _submit(self, sentences: list[str]) -> None:
        if self.script is not None:      # each sentence says who speaks it
            sentences = self.script.clauses(sentences)
        for text in sentences:
            if not text.strip():
                continue
            handle = await self.serving.start(text, self._voice(text), "text",
                                              ("max_new_tokens", self.max_new_tokens))
            self.handles.append(handle)
            await self.queue.put((self.num_sentences, text, handle))   # waits past the share
            self.num_sentences += 1

    async def _speak(self) -> None:
        while (item := await self.queue.get()) is not None:
            idx, text, handle = item
            await self._send({"type": "audio.start", "sentence_index": idx,
                              "sentence_text": text})
            total, error = 0, None
            try:
                encoder: AudioEncoder | None = None
                async for wave, rate in self.serving.waves(handle):
                    encoder = encoder or AudioEncoder(ENCODING[self.fmt], rate)
                    total += await self._bytes(await run_in_threadpool(encoder.encode, wave))
                if encoder is not None:
                    total += await self._bytes(await run_in_threadpool(encoder.close))
            except APIError as err:
                error = err.message
            finally:
                handle.close()
                self.handles.remove(handle)
            done: dict[str, Any] = {"type": "audio.done", "sentence_index": idx,
                                    "total_bytes": total}
            await self._send(done if error is None else {**done, "error": error})
        await self._send({"type": "session.done", "total_sentences": self.num_sentences})
        await self.ws.close(1000)

    async def _bytes(self, data: bytes) -> int:
        if data and self.ws.application_state == WebSocketState.CONNECTED:
            async with self._send_lock:
                await self.ws.send_bytes(data)
        return len(data)

    async def _send(self, event: dict[str, Any]) -> None:
        if self.ws.application_state == WebSocketState.CONNECTED:
            async with self._send_lock:
                await self.ws.send_text(json.dumps(event, separators=(",", ":")))
