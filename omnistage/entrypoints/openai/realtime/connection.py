"""WebSocket /v1/realtime: one session of OpenAI's Realtime protocol (GA event names) over a
model that hears and speaks (Qwen3-Omni), or one that speaks (the voice agent graph).

    client                                        server
    session.update                           ->   session.updated
    input_audio_buffer.append (PCM16 b64)    ->   [server_vad / semantic_vad: turn.py]
                                                  input_audio_buffer.speech_started
                                                  (a response playing is cancelled: barge-in)
                                                  input_audio_buffer.speech_stopped,
                                                  input_audio_buffer.committed,
                                                  conversation.item.added/.done, then a response
    input_audio_buffer.commit / .clear       ->   input_audio_buffer.committed / .cleared
    conversation.item.create / .delete / .truncate -> conversation.item.added+done / .deleted
                                                  / .truncated
    response.create                          ->   response.created ... response.done
                                                  (a response still running is cancelled first)
    response.cancel                          ->   response.done with status cancelled

Each response's prompt is the instructions and the newest items that fit the model's context
with room for the answer; what goes when the conversation outgrows it is the session's
`truncation` ("auto", "disabled" or a retention ratio: truncation.py).

A bad event gets an `error` event naming the field (and echoing its `event_id`) and the session
goes on; a frame is parsed under the HTTP routes' JSON policy (json_body.py), so a lone
surrogate, NaN or an integer beyond 64 bits is refused here, not somewhere downstream.
Closing the socket (code 1000) at any moment cancels the running response (aborted in every
stage) and ends the session; a socket that drops otherwise leaves the session waiting for a
resume for its grace period (resume.py), then the same. A session idle (no client event) for
`idle_timeout_s` is told so and closed. A first event in vLLM-Omni's dialect: vllm_dialect.py.
A model that speaks but does not hear (the voice agent graph) takes text items only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable

from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from omnistage.entrypoints.openai.client import EngineClient, RequestHandle
from omnistage.entrypoints.openai.errors import APIError, bad_request, check_model
from omnistage.entrypoints.openai.realtime.audio_buffer import (AudioBuffer, decode_pcm16,
                                                                ms_to_samples, samples_to_ms)
from omnistage.entrypoints.openai.realtime.conversation import (Conversation, ConversationItem,
                                                                Part, item_from_event)
from omnistage.entrypoints.openai.realtime.protocol import (AudioConfig, AudioInput, Item,
                                                            ResponseOptions,
                                                            RetentionRatio, Session,
                                                            client_event, error_event, event,
                                                            event_id_of, max_tokens, merge,
                                                            new_id, parse)
from omnistage.entrypoints.openai.realtime.limits import RealtimeLimits as RealtimeLimits
from omnistage.entrypoints.openai.realtime.limits import hears, realtime_support
from omnistage.entrypoints.openai.realtime.response import Response, ResponsePlan
from omnistage.entrypoints.openai.realtime.resume import (KEEP_SESSION, Journal,
                                                          ResumableSocket, Sessions,
                                                          grace_of, new_token)
from omnistage.entrypoints.openai.realtime.truncation import submit
from omnistage.entrypoints.openai.realtime.turn import TurnTaking, silero_settings
from omnistage.entrypoints.openai.realtime.vad import FRAME, TurnDetector
from omnistage.entrypoints.openai.realtime.vllm_dialect import VllmDialect, is_vllm_first

logger = logging.getLogger(__name__)


class RealtimeConnection(ResumableSocket):
    def __init__(self, ws: WebSocket, client: EngineClient, model_name: str,
                 limits: RealtimeLimits, sessions: Sessions | None = None) -> None:
        self.ws, self.client, self.model_name, self.limits = ws, client, model_name, limits
        self.hears = hears(client)                  # False: text items in, speech out
        self.session = Session(model=model_name) if limits.server_vad and self.hears else Session(
            model=model_name, audio=AudioConfig(input=AudioInput(turn_detection=None)))
        self.conversation = Conversation(limits.max_items)
        self.conversation_id = new_id("conv")
        self.buffer = AudioBuffer()
        self.vad: TurnDetector | None = None
        self.turns = TurnTaking(self)               # what the detector's events do (turn.py)
        self.speech_item_id: str | None = None      # the user item a detected turn becomes
        self.response: Response | None = None
        self.response_task: asyncio.Task[None] | None = None
        self._send_lock = asyncio.Lock()
        self._instruction_tokens: dict[str, int] = {}   # the last instructions measured
        self.dialect: Callable[[dict[str, Any]], Any] | None = None   # the first event's
        self.sessions = sessions if sessions is not None else Sessions()   # resume.py
        self.session_id = self.session.id
        self.attached = False                       # a socket serves the session now
        self.resume_token: str | None = None
        self.journal: Journal | None = None         # None: not resumable
        self._grace: asyncio.Task[None] | None = None
        self._grace_s = 0.0

    async def run(self) -> None:
        await self.ws.accept()
        why = realtime_support(self.client)
        if why is not None:
            await self._send(error_event(APIError(400, why, code="model_not_realtime")))
            await self.ws.close(1008)
            return
        model = self.ws.query_params.get("model")
        try:
            check_model(model, self.model_name)
            await self._apply_session(self.session)
            grace_s = grace_of(self.ws.query_params, self.limits.resume_grace_s)
        except APIError as err:
            await self._send(error_event(err))
            await self.ws.close(1008)
            return
        resumable = {}
        if grace_s > 0:
            self.resume_token = new_token()
            resumable = {"resume_token": self.resume_token}
        self.attached = True
        self.sessions.add(self.session_id, self)
        await self._send(event("session.created", session=self._session_json(), **resumable))
        if grace_s > 0:
            self.journal = Journal(self.limits.resume_journal_bytes)
        self._grace_s = grace_s
        await self._serve()

    # -- the session's sockets (resume.py) ---------------------------------------------------
    async def _serve(self) -> None:
        """One socket's life: its events until it goes; then the session ends, or waits its
        grace period for a resume (a socket that dropped without closing cleanly)."""
        self.attached, resumable = True, False
        try:
            resumable = await self._receive()
        finally:
            self.attached = False
            if resumable and self.journal is not None and self.sessions.live.get(
                    self.session_id) is self:
                self._grace = asyncio.create_task(self._expire(self._grace_s))
            else:
                await self.end("client_disconnected")

    async def end(self, reason: str) -> None:
        """The session is over: its response aborted in every stage, the session freed."""
        self.sessions.remove(self.session_id, self)
        self.journal, self.resume_token = None, None
        await self.turns.close()
        await self._cancel_response(reason)

    # -- the loop ----------------------------------------------------------------------------
    async def _receive(self) -> bool:
        """The socket's events until it goes; whether it dropped (a resume may follow)."""
        while True:
            try:
                message = await asyncio.wait_for(self.ws.receive(), self.limits.idle_timeout_s)
            except TimeoutError:
                if self.response is not None and not self.response.done.is_set():
                    continue                   # an answer still streaming is not idleness
                await self._send(error_event(APIError(
                    400, f"the session was idle for {self.limits.idle_timeout_s:g} s and is "
                         "closed", code="session_idle_timeout")))
                await self.ws.close(1000)
                return False
            except WebSocketDisconnect as exc:
                return exc.code not in KEEP_SESSION
            except RuntimeError:
                return False
            if message["type"] == "websocket.disconnect":
                return message.get("code", 1000) not in KEEP_SESSION
            raw, msg = message.get("text"), None
            try:
                msg = client_event(raw)
                if self.dialect is None:
                    self.dialect = VllmDialect(self).handle if is_vllm_first(msg) else self._handle
                await self.dialect(msg)
            except APIError as err:
                if err.status == 503:          # the engine is gone: nothing more to serve
                    await self._send(error_event(err))
                    await self.ws.close(1011)
                    return False
                await self._send(error_event(err, event_id_of(msg, raw)))
            except Exception:                  # our fault: said so, and the session goes on
                logger.exception("realtime event %s failed", event_id_of(msg, raw))
                await self._send(error_event(APIError(500, "the server failed to handle the "
                                                           "event", code="internal_error"),
                                             event_id_of(msg, raw)))

    async def _handle(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        handler = {
            "session.update": self._session_update,
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit_event,
            "input_audio_buffer.clear": self._clear,
            "conversation.item.create": self._item_create,
            "conversation.item.delete": self._item_delete,
            "conversation.item.truncate": self._item_truncate,
            "response.create": self._response_create,
            "response.cancel": self._response_cancel,
            "session.event_ack": self._event_ack,
        }.get(kind if isinstance(kind, str) else "")
        if handler is None:
            raise bad_request(f"type: {kind!r} is not a client event this server handles",
                              "type", "invalid_event")
        await handler(msg)

    # -- session -----------------------------------------------------------------------------
    async def _session_update(self, msg: dict[str, Any]) -> None:
        body = msg.get("session")
        if not isinstance(body, dict):
            raise bad_request("session: an object is required", "session")
        current = self.session.model_dump()
        session = parse(Session, merge(current, body), "session")
        check_model(session.model, self.model_name)
        await self._apply_session(session)
        await self._send(event("session.updated", session=self._session_json()))

    async def _event_ack(self, msg: dict[str, Any]) -> None:
        """vLLM-Omni's: the client has the events up to `server_event_seq`; no answer."""
        if self.journal is not None:
            self.journal.acknowledge(msg.get("server_event_seq"))

    async def _apply_session(self, session: Session) -> None:
        """Check the voice with the engine, and (re)start voice detection as configured."""
        voice = session.audio.output.voice
        if voice is not None:
            self._prepare_check(voice, "session.audio.output.voice")
        limits = (session.truncation.token_limits
                  if isinstance(session.truncation, RetentionRatio) else None)
        max_len = self.client.max_model_len
        if limits is not None and limits.post_instructions is not None and max_len is not None \
                and limits.post_instructions >= max_len:
            raise bad_request(f"session.truncation.token_limits.post_instructions="
                              f"{limits.post_instructions}: must be under the model's context "
                              f"of {max_len} tokens", "session.truncation.token_limits."
                              "post_instructions")
        vad = session.audio.input.turn_detection
        old = self.session.audio.input.turn_detection
        if vad is None or self.vad is None or vad != old:   # Silero loads at its first audio
            self.vad = None if vad is None else TurnDetector(*silero_settings(vad))
            if self.vad is not None:
                self.vad.num_frames = self.buffer.end // FRAME
            self.turns.configure(vad)
        self.session = session

    def _prepare_check(self, voice: str, param: str) -> None:
        """An unknown voice is refused now, not at the first response."""
        speakers = {s for info in self.client.engine.orchestrator.stage_info.values()
                    for s in info.speakers}
        if speakers and voice.lower() not in speakers:
            raise bad_request(f"{param}: {voice!r} is not a voice of this model (it has: "
                              f"{', '.join(sorted(speakers))})", param, "unknown_voice")

    def _session_json(self) -> dict[str, Any]:
        return self.session.model_dump(mode="json")

    # -- input audio -------------------------------------------------------------------------
    async def _append(self, msg: dict[str, Any]) -> None:
        self._check_hears("audio")
        rate = self.session.audio.input.format.rate
        samples = await run_in_threadpool(decode_pcm16, msg.get("audio"), rate, "audio")
        if (self.buffer.num_samples + len(samples)) * 2 > self.limits.max_buffer_bytes:
            raise bad_request(f"audio: the input audio buffer would pass its limit of "
                              f"{self.limits.max_buffer_bytes} bytes (PCM16 at 16 kHz); commit "
                              "or clear it", "audio", "input_audio_buffer_full")
        self.buffer.append(samples)
        if self.vad is not None:         # speech start / stop, and the turns they end
            await self.turns.hear(samples)

    def _check_hears(self, param: str) -> None:
        if not self.hears:
            raise bad_request(f"{param}: this model does not hear (a text LLM speaking through "
                              "a TTS); send text: conversation.item.create with input_text",
                              param, "audio_input_unsupported")

    async def _commit_event(self, msg: dict[str, Any]) -> None:
        held_ms = samples_to_ms(self.buffer.num_samples)
        if held_ms < 100:
            raise bad_request(f"the input audio buffer holds {held_ms} ms; a commit needs at "
                              "least 100 ms", None, "input_audio_buffer_commit_empty")
        if self.buffer.num_samples > ms_to_samples(int(self.limits.max_turn_s * 1000)):
            self.buffer.clear()
            raise bad_request(f"the input audio is longer than the turn limit of "
                              f"{self.limits.max_turn_s:g} s; the buffer was cleared", None,
                              "turn_too_long")
        self.turns.cancel()              # a turn semantic_vad was judging is this one
        await self._commit(None, new_id("item"))

    async def _commit(self, until: int | None, item_id: str) -> None:
        """The buffer (up to timeline index `until`) becomes a user audio item."""
        item = ConversationItem("user", [Part("audio", audio=self.buffer.take(until))],
                                id=item_id)
        previous = self.conversation.add(item)
        await self._send(event("input_audio_buffer.committed", item_id=item.id,
                               previous_item_id=previous))
        await self._item_events(item, previous)

    async def _clear(self, msg: dict[str, Any]) -> None:
        self.buffer.clear()
        self.turns.cancel()
        await self._send(event("input_audio_buffer.cleared"))

    # -- conversation ------------------------------------------------------------------------
    async def _item_create(self, msg: dict[str, Any]) -> None:
        item = parse(Item, msg.get("item"), "item")
        for j, part in enumerate(item.content):
            if part.type == "input_audio":
                self._check_hears(f"item.content[{j}].audio")
        rate = self.session.audio.input.format.rate
        converted = await run_in_threadpool(
            item_from_event, item, lambda b64, param: decode_pcm16(b64, rate, param))
        previous = msg.get("previous_item_id")
        if previous is not None and not isinstance(previous, str):
            raise bad_request("previous_item_id: a string or null", "previous_item_id")
        before = self.conversation.add(converted, previous)
        await self._item_events(converted, before)

    async def _item_events(self, item: ConversationItem, previous: str | None) -> None:
        shown = item.as_event_item()
        await self._send(event("conversation.item.added", item=shown, previous_item_id=previous))
        await self._send(event("conversation.item.done", item=shown, previous_item_id=previous))

    async def _item_delete(self, msg: dict[str, Any]) -> None:
        item_id = msg.get("item_id")
        self.conversation.delete(str(item_id))
        await self._send(event("conversation.item.deleted", item_id=item_id))

    async def _item_truncate(self, msg: dict[str, Any]) -> None:
        item_id, index, end = (msg.get("item_id"), msg.get("content_index"),
                               msg.get("audio_end_ms"))
        if not isinstance(index, int) or not isinstance(end, int):
            raise bad_request("content_index and audio_end_ms: integers are required",
                              "audio_end_ms")
        self.conversation.truncate(str(item_id), index, end,
                                   self.session.audio.output.format.rate)
        await self._send(event("conversation.item.truncated", item_id=item_id,
                               content_index=index, audio_end_ms=end))

    # -- responses ---------------------------------------------------------------------------
    async def _response_create(self, msg: dict[str, Any]) -> None:
        requested = time.monotonic()         # first audio is counted from here
        options = parse(ResponseOptions, msg.get("response"), "response")
        plan = self._plan(options)
        instructions = (options.instructions if options.instructions is not None
                        else self.session.instructions)
        await self._cancel_response("client_cancelled")     # one response at a time
        handle = await self._submit(instructions, plan)
        item = ConversationItem("assistant", [Part(plan.modality)], status="in_progress")
        try:
            previous = self.conversation.add(item)
        except APIError:
            handle.close()
            raise
        response = Response(self.client, plan, item, self._send, self.conversation_id)
        response.started = requested
        self.response = response
        await response.start_events(previous)
        self.response_task = asyncio.create_task(response.run(handle))

    def _plan(self, options: ResponseOptions) -> ResponsePlan:
        s = self.session
        modality = (options.output_modalities or s.output_modalities)[0]
        voice = ((options.audio or {}).get("output") or {}).get("voice", s.audio.output.voice)
        if voice is not None:
            self._prepare_check(str(voice), "response.audio.output.voice")
        limit = (options.max_output_tokens if options.max_output_tokens is not None
                 else s.max_output_tokens)
        return ResponsePlan(modality, voice, max_tokens(limit), s.audio.output.format.rate,
                            options.metadata)

    async def _submit(self, instructions: str, plan: ResponsePlan) -> RequestHandle:
        return await submit(self.client, self.conversation, instructions,
                            self.session.truncation, plan, self._instruction_tokens)

    async def _response_cancel(self, msg: dict[str, Any]) -> None:
        if self.response is None or self.response.done.is_set():
            raise bad_request("no response is in progress", None, "response_cancel_not_active")
        await self._cancel_response("client_cancelled")

    async def _cancel_response(self, reason: str) -> None:
        """Cancel the running response (aborted in every stage) and wait for its last events."""
        response, task = self.response, self.response_task
        if response is None or task is None:
            return
        response.cancel(reason)
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=10)
        except (TimeoutError, WebSocketDisconnect, RuntimeError):
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        except Exception:    # the response's own failure: logged, the session goes on
            logger.exception("realtime response %s failed", response.id)

    async def _send(self, ev: dict[str, Any]) -> None:
        """Send (and journal, for a resume to replay: resume.py) one server event."""
        async with self._send_lock:
            text = self.journal.record(ev) if self.journal is not None else \
                json.dumps(ev, separators=(",", ":"))
            if self.ws.application_state != WebSocketState.CONNECTED:
                return
            try:
                await self.ws.send_text(text)
            except (WebSocketDisconnect, RuntimeError):   # the client went: the loop sees it
                pass
