"""WebSocket /v1/realtime in vLLM-Omni's dialect (its openai_realtime_client.py), chosen by the
session's first client event: `session.update` with `model` at the top level (OpenAI's nests
it in `session`), or `input_audio_buffer.commit` with `final`. connection.py keeps OpenAI's
protocol otherwise; its `session.created`, sent before any client event, is the one event
this dialect's client skips.

    client -> server
      {"type": "session.update", "model": "..."}              the model is checked; no answer
      {"type": "input_audio_buffer.commit", "final": false}   opens a turn
      {"type": "input_audio_buffer.append", "audio": "<base64 PCM16, 16 kHz mono>"}   (many)
      {"type": "input_audio_buffer.commit", "final": true}    closes it: the answer starts
    server -> client, for each turn
      {"type": "transcription.delta", "delta": "..."}         the answer's text as it comes,
      {"type": "response.output_audio.delta", "audio": "<base64 PCM16>", "format": "pcm16",
       "sample_rate_hz": 24000}                               its speech, interleaved with it
      {"type": "transcription.done", "text": "...", "usage": {"prompt_tokens",
       "completion_tokens", "total_tokens", "prompt_tokens_details": {"cached_tokens"}}}
      {"type": "response.output_audio.done", "has_audio": true}

A bad event gets the `error` event OpenAI's dialect sends (its `error` object names the
field) and the session goes on; an answer that fails sends `error`, then
`response.output_audio.done`. The turn runs on the session's own machinery: the audio buffer
(voice detection off: the client's commits bound the turn), the conversation (a later turn
hears the earlier ones, from the prefix cache) and response.py's runner, whose OpenAI events
`Relay` turns into the ones above. vLLM-Omni's older clients read `response.audio.delta` /
`.done`; its current one reads the `response.output_audio.*` names sent here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from omnistage.entrypoints.openai.errors import APIError, bad_request, check_model
from omnistage.entrypoints.openai.realtime.audio_buffer import (
    ms_to_samples,
    samples_to_ms,
)
from omnistage.entrypoints.openai.realtime.conversation import ConversationItem, Part
from omnistage.entrypoints.openai.realtime.protocol import (
    OUTPUT_RATE,
    ResponseOptions,
    Session,
    event,
    merge,
    parse,
)
from omnistage.entrypoints.openai.realtime.response import Response, Send

EVENTS = {"session.update": ("model",), "input_audio_buffer.append": ("audio",),
          "input_audio_buffer.commit": ("final",)}
MIN_TURN_MS = 100
INPUT_RATE = 16000   # vLLM-Omni's client sends PCM16 at 16 kHz without saying so (OpenAI's: 24)


def is_vllm_first(msg: dict[str, Any]) -> bool:
    """Whether a session's first event is vLLM-Omni's (OpenAI's never looks like this)."""
    kind = msg.get("type")
    return (kind == "session.update" and "model" in msg and "session" not in msg) or \
        (kind == "input_audio_buffer.commit" and "final" in msg)


def check_event(msg: dict[str, Any]) -> str:
    """The event's type; a 400 naming the type or field this dialect does not have."""
    kind = msg.get("type")
    fields = EVENTS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise bad_request(f"type: {kind!r} is not an event of vLLM-Omni's realtime dialect, "
                          f"which this session speaks since its first event (it has: "
                          f"{', '.join(EVENTS)})", "type", "invalid_event")
    unknown = sorted(set(msg) - {"type", "event_id", *fields})
    if unknown:
        raise bad_request(f"{unknown[0]}: not a field of {kind} in vLLM-Omni's realtime "
                          f"dialect (it has: {', '.join(fields)})", unknown[0], "unknown_field")
    if kind == "session.update" and not isinstance(msg["model"], str):
        raise bad_request("model: a string is required", "model")
    if kind == "input_audio_buffer.commit" and not isinstance(msg.get("final", False), bool):
        raise bad_request("final: true or false is required", "final")
    return kind


def vllm_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """response.py's usage as vLLM's: completion tokens are the thinker's (the text)."""
    prompt = usage.get("input_tokens", 0)
    completion = (usage.get("output_token_details") or {}).get("text_tokens", 0)
    cached = (usage.get("input_token_details") or {}).get("cached_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Relay:
    """One response's OpenAI events (response.py) sent on as vLLM-Omni's."""

    def __init__(self, send: Send, rate: int) -> None:
        self.send_on, self.rate = send, rate
        self.text, self.has_audio = "", False

    async def send(self, ev: dict[str, Any]) -> None:
        for out in self.translate(ev):
            await self.send_on(out)

    def translate(self, ev: dict[str, Any]) -> list[dict[str, Any]]:
        kind = ev["type"]
        if kind == "response.output_audio_transcript.delta":
            self.text += ev["delta"]
            return [{"type": "transcription.delta", "delta": ev["delta"]}]
        if kind == "response.output_audio.delta":
            self.has_audio = True
            return [{"type": "response.output_audio.delta", "audio": ev["delta"],
                     "format": "pcm16", "sample_rate_hz": self.rate}]
        if kind != "response.done":
            return []
        response = ev["response"]
        if response["status"] == "failed":
            first = event("error", error={**response["status_details"]["error"],
                                          "param": None, "event_id": None})
        else:
            first = {"type": "transcription.done", "text": self.text,
                     "usage": vllm_usage(response.get("usage") or {})}
        return [first, {"type": "response.output_audio.done", "has_audio": self.has_audio}]


class VllmDialect:
    """The events of one session in vLLM-Omni's dialect, handled on its RealtimeConnection
    (`conn`: connection.py, which imports this module), whose loop reads them."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.is_ready = False
        self.is_turn_open = False

    async def handle(self, msg: dict[str, Any]) -> None:
        if not self.is_ready:
            await self._setup()
        kind = check_event(msg)
        if kind == "session.update":
            check_model(msg["model"], self.conn.model_name)
        elif kind == "input_audio_buffer.append":
            await self.conn._append(msg)
        elif msg.get("final", False):
            await self._close_turn()
        elif self.is_turn_open:
            raise bad_request("input_audio_buffer.commit final=false: a turn is already open; "
                              "close it with final=true first", "final", "turn_already_open")
        else:
            self.is_turn_open = True

    async def _setup(self) -> None:
        """Voice detection off (the client's commits bound a turn), audio in at 16 kHz and
        speech out at the model's own rate (as vLLM-Omni's client sends and reads them)."""
        conn = self.conn
        rate = conn.client.engine.audio_sample_rate or OUTPUT_RATE
        body = merge(conn.session.model_dump(), {"audio": {
            "input": {"turn_detection": None, "format": {"rate": INPUT_RATE}},
            "output": {"format": {"rate": rate}}}})
        await conn._apply_session(parse(Session, body, "session"))
        self.is_ready = True

    async def _close_turn(self) -> None:
        """The buffered audio becomes the user's item and the answer starts (after the
        previous answer, if one still streams)."""
        conn = self.conn
        if not self.is_turn_open:
            raise bad_request("input_audio_buffer.commit final=true: no turn is open; open one "
                              "with final=false first", "final", "turn_not_open")
        self.is_turn_open = False
        held_ms = samples_to_ms(conn.buffer.num_samples)
        if held_ms < MIN_TURN_MS:
            raise bad_request(f"the turn holds {held_ms} ms of audio; a turn needs at least "
                              f"{MIN_TURN_MS} ms (input_audio_buffer.append between its two "
                              "commits)", "audio", "input_audio_buffer_commit_empty")
        if conn.buffer.num_samples > ms_to_samples(int(conn.limits.max_turn_s * 1000)):
            conn.buffer.clear()
            raise bad_request(f"the turn's audio is longer than the limit of "
                              f"{conn.limits.max_turn_s:g} s; it was dropped", "audio",
                              "turn_too_long")
        if conn.response_task is not None:
            await asyncio.wait({conn.response_task})
        conn.conversation.add(ConversationItem("user", [Part("audio",
                                                            audio=conn.buffer.take())]))
        await self._answer()

    async def _answer(self) -> None:
        conn = self.conn
        plan = conn._plan(ResponseOptions())
        handle = await conn._submit(conn.session.instructions, plan)
        item = ConversationItem("assistant", [Part(plan.modality)], status="in_progress")
        try:
            conn.conversation.add(item)
        except APIError:
            handle.close()
            raise
        relay = Relay(conn._send, plan.output_rate)
        conn.response = Response(conn.client, plan, item, relay.send, conn.conversation_id)
        conn.response_task = asyncio.create_task(conn.response.run(handle))
