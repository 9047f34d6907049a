"""WebSocket /v1/realtime: one session of OpenAI's Realtime protocol (GA event names) over a
model that hears and speaks (Qwen3-Omni).

    client                                        server
    session.update                           ->   session.updated
    input_audio_buffer.append (PCM16 b64)    ->   [server_vad] input_audio_buffer.speech_started
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
Closing the socket at any moment cancels the running response (aborted in every stage) and
ends the session; nothing it started outlives it. A session idle (no client event) for
`idle_timeout_s` is told so and closed. A first event in vLLM-Omni's dialect: vllm_dialect.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from omnistage.engine.request import OmniRequest, RequestFields
from omnistage.entrypoints.openai.client import EngineClient, Ready, RequestHandle
from omnistage.entrypoints.openai.errors import (APIError, bad_request, check_model,
                                                  from_value_error)
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
from omnistage.entrypoints.openai.realtime.response import Response, ResponsePlan
from omnistage.entrypoints.openai.realtime.truncation import measure, num_to_drop, output_room
from omnistage.entrypoints.openai.realtime.vad import FRAME, TurnDetector, VadEvent
from omnistage.entrypoints.openai.realtime.vllm_dialect import VllmDialect, is_vllm_first

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RealtimeLimits:
    max_buffer_bytes: int = 15 << 20     # input audio held (as PCM16 at 16 kHz); more: error
    max_turn_s: float = 60.0             # a longer user turn is cut (VAD) or refused (commit)
    idle_timeout_s: float = 600.0        # no client event this long: the session ends
    max_items: int = 1000                # conversation items a session may hold
    server_vad: bool = True              # a new session's turn detection (off: vLLM-Omni's)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "server_vad" and getattr(self, f.name) <= 0:
                raise ValueError(f"realtime {f.name}={getattr(self, f.name)}: must be > 0")


def realtime_support(client: EngineClient) -> str | None:
    """Why this model cannot hold a realtime session (None: it can)."""
    processor = client.processor
    if processor is None or getattr(processor, "feature_extractor", None) is None:
        return "this model does not take audio input; /v1/realtime needs a model that hears " \
               "and speaks (Qwen3-Omni)"
    if "audio" not in client.outputs:
        return "this model does not produce audio; /v1/realtime needs a model that hears " \
               "and speaks (Qwen3-Omni)"
    return None


class RealtimeConnection:
    def __init__(self, ws: WebSocket, client: EngineClient, model_name: str,
                 limits: RealtimeLimits) -> None:
        self.ws, self.client, self.model_name, self.limits = ws, client, model_name, limits
        self.session = Session(model=model_name) if limits.server_vad else Session(
            model=model_name, audio=AudioConfig(input=AudioInput(turn_detection=None)))
        self.conversation = Conversation(limits.max_items)
        self.conversation_id = new_id("conv")
        self.buffer = AudioBuffer()
        self.vad: TurnDetector | None = None
        self.speech_item_id: str | None = None      # the user item a detected turn becomes
        self.response: Response | None = None
        self.response_task: asyncio.Task[None] | None = None
        self._send_lock = asyncio.Lock()
        self._instruction_tokens: dict[str, int] = {}   # the last instructions measured
        self.dialect: Callable[[dict[str, Any]], Any] | None = None   # the first event's

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
        except APIError as err:
            await self._send(error_event(err))
            await self.ws.close(1008)
            return
        await self._send(event("session.created", session=self._session_json()))
        try:
            await self._receive()
        finally:
            await self._cancel_response("client_disconnected")

    # -- the loop ----------------------------------------------------------------------------
    async def _receive(self) -> None:
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
                return
            except (WebSocketDisconnect, RuntimeError):
                return
            if message["type"] == "websocket.disconnect":
                return
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
                    return
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
        if vad is None:
            self.vad = None
        elif self.vad is None or vad != old:     # Silero loads at its first audio (vad.py)
            self.vad = TurnDetector(vad.threshold, vad.silence_duration_ms, vad.prefix_padding_ms)
            self.vad.num_frames = self.buffer.end // FRAME
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
        rate = self.session.audio.input.format.rate
        samples = await run_in_threadpool(decode_pcm16, msg.get("audio"), rate, "audio")
        if (self.buffer.num_samples + len(samples)) * 2 > self.limits.max_buffer_bytes:
            raise bad_request(f"audio: the input audio buffer would pass its limit of "
                              f"{self.limits.max_buffer_bytes} bytes (PCM16 at 16 kHz); commit "
                              "or clear it", "audio", "input_audio_buffer_full")
        self.buffer.append(samples)
        if self.vad is None:
            return
        for ev in await run_in_threadpool(self.vad.feed, samples):
            await self._vad_event(ev)
        turn = self.limits.max_turn_s
        if self.vad.speaking and self.buffer.num_samples > ms_to_samples(int(turn * 1000)):
            stop = self.vad.force_stop()
            if stop is not None:
                await self._vad_event(stop)
        elif not self.vad.speaking:      # hold only the padding a coming turn starts with
            vad = self.session.audio.input.turn_detection
            assert vad is not None
            self.buffer.drop_before(self.buffer.end - ms_to_samples(vad.prefix_padding_ms))

    async def _vad_event(self, ev: VadEvent) -> None:
        vad = self.session.audio.input.turn_detection
        assert vad is not None
        if ev.kind == "speech_started":
            self.speech_item_id = new_id("item")
            self.buffer.drop_before(ms_to_samples(ev.ms))
            await self._send(event("input_audio_buffer.speech_started", audio_start_ms=ev.ms,
                                   item_id=self.speech_item_id))
            if vad.interrupt_response:
                await self._cancel_response("turn_detected")
            return
        item_id = self.speech_item_id or new_id("item")
        self.speech_item_id = None
        await self._send(event("input_audio_buffer.speech_stopped", audio_end_ms=ev.ms,
                               item_id=item_id))
        await self._commit(ms_to_samples(ev.ms), item_id)
        if vad.create_response:
            await self._response_create({})

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
        await self._send(event("input_audio_buffer.cleared"))

    # -- conversation ------------------------------------------------------------------------
    async def _item_create(self, msg: dict[str, Any]) -> None:
        item = parse(Item, msg.get("item"), "item")
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
        """The conversation as one engine request, through the front door (admitted, then
        checked and fit to the context, submitted)."""
        if not self.conversation.context():
            raise bad_request("the conversation is empty: add an item or commit audio first",
                              None, "conversation_empty")
        fields = RequestFields({} if plan.max_tokens is None else
                               {"max_tokens": plan.max_tokens}, voice=plan.voice)
        wanted = {"text", "audio"} if plan.modality == "audio" else {"text"}

        def request(prompt: dict[str, Any]) -> OmniRequest:
            return self.client.request(prompt, fields, wanted, "rt", param="conversation")

        async def make() -> list[Ready]:
            return [await self._prepare(instructions, request, plan)]

        [handle] = await self.client.start(make, 1)
        return handle

    async def _prepare(self, instructions: str,
                       request: Callable[[dict[str, Any]], OmniRequest],
                       plan: ResponsePlan) -> Ready:
        """The request of the conversation's context, prepared. One over the model's input
        limit (room left for the response's output) is cut as the session's truncation says
        (truncation.py), then prepared again."""
        max_len = self.client.max_model_len
        limit = None if max_len is None else max_len - output_room(plan.max_tokens, max_len)
        fits = limit
        truncation = self.session.truncation
        if limit is not None and isinstance(truncation, RetentionRatio) \
                and truncation.token_limits is not None \
                and truncation.token_limits.post_instructions is not None:
            known = self._instruction_tokens.get(instructions, 0)   # 0: not measured yet
            fits = min(limit, truncation.token_limits.post_instructions + known)
        made = request({"messages": self.conversation.messages(instructions)})
        prepared, refusal = None, None
        try:
            prepared = await run_in_threadpool(self.client.prepare, made)
            if fits is None or prepared[0].num_tokens <= fits:
                return made, prepared
        except APIError as err:      # perhaps over max_model_len: measured below
            if limit is None:
                raise
            refusal = err
        num_dropped = 0
        while True:                  # each round drops one item or more, never the newest
            try:
                size = await run_in_threadpool(measure, self.client.processor,
                                               made.prompt["messages"], bool(instructions))
            except ValueError as exc:
                raise from_value_error(exc, "conversation") from None
            self._instruction_tokens = {instructions: size.instructions}
            num = num_to_drop(size, limit, truncation)
            if num == 0:
                break
            self.conversation.drop_oldest(num)
            num_dropped += num
            made = request({"messages": self.conversation.messages(instructions)})
        if num_dropped == 0:         # it fits: a refusal was for something else
            if refusal is not None:
                raise refusal
            return made, prepared
        return made, await run_in_threadpool(self.client.prepare, made)

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
        if self.ws.application_state != WebSocketState.CONNECTED:
            return
        try:
            async with self._send_lock:
                await self.ws.send_text(json.dumps(ev, separators=(",", ":")))
        except (WebSocketDisconnect, RuntimeError):   # the client went; the loop ends it all
            pass
