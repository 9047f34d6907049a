"""The /v1/duplex protocol: JSON text frames, event names as vLLM-Omni's full-duplex sessions
send them (its `/v1/realtime?duplex=1` and the alias `/v1/duplex`, PR #7413; PersonaPlex /
MiniCPM-o: OpenAI's Realtime names, the GA spellings `response.output_audio.delta` /
`response.output_audio_transcript.delta` since its PR #7339; a lockstep model takes no
commits and answers on its own) and its resume protocol (realtime/resume.py). Where neither
says, OpenAI Realtime's conventions:

    client -> server
      input_audio_buffer.append {audio: base64 PCM16 mono at the model's rate (24 kHz)}
      input_audio_buffer.clear                          -> input_audio_buffer.cleared
      session.update {session: {audio: {input|output: {format: {type: "audio/pcm",
                      rate: 24000}}}}}                  -> session.updated (only that format)
      session.event_ack {server_event_seq}              (resume.py: the journal forgets)
      session.close                                     -> session.ended, then close 1000
                                                           (ours: the final event's stats)
    server -> client
      session.created {session, resume_token}, response.created {response}   (once)
      per tick: response.output_audio_transcript.delta {response_id, delta, token_id, tick,
                heard, input_missed}     the inner-monologue token (delta "" w/o tokenizer)
                response.output_audio.delta {response_id, delta, tick, codes, latency_ms,
                missed_tick}             one 80 ms frame of Moshi's speech (not at tick 0)
      session.ended {session_id, reason, stats}   the last event (ours): missed ticks,
                missed inputs, tick latency p50 / p99 / max
      error {error: {type, code, message, param, event_id}}   a bad event; the session goes on

Sampling is chosen when the socket opens, by query parameters (ours, `sampling_of`):
`temperature` and `top_k` of the inner monologue's text, `audio_temperature` and `audio_top_k`
of Moshi's codes (0: greedy, the default; the released generation config samples 0.7 / 25 and
0.8 / 250), `seed` (the session's own RNG); a bad value refuses the socket (close 1008) with
an error naming the parameter.

`tick`, `token_id`, `codes`, `heard`, `input_missed`, `latency_ms`, `missed_tick` and
`session.ended` / `session.close` are our extensions (neither vLLM-Omni nor OpenAI defines
them); clients that do not know them ignore them.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omnistage.engine.duplex import DuplexSampling
from omnistage.entrypoints.openai.errors import APIError, bad_request
from omnistage.entrypoints.openai.realtime.protocol import parse

CLIENT_EVENTS = ("input_audio_buffer.append", "input_audio_buffer.clear", "session.update",
                 "session.event_ack", "session.close")
MAX_EVENT_BYTES = 1 << 20            # a text frame larger than this is refused unread


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PCMFormat(_Strict):
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: int


class Direction(_Strict):
    format: PCMFormat | None = None


class AudioConfig(_Strict):
    input: Direction | None = None
    output: Direction | None = None


class SessionUpdate(_Strict):
    type: Literal["realtime"] | None = None
    model: str | None = None
    audio: AudioConfig | None = None


class UpdateEvent(_Strict):
    type: Literal["session.update"]
    event_id: str | None = None
    session: SessionUpdate = Field(default_factory=SessionUpdate)


class AppendEvent(_Strict):
    type: Literal["input_audio_buffer.append"]
    event_id: str | None = None
    audio: str


class PlainEvent(_Strict):
    type: Literal["input_audio_buffer.clear", "session.close"]
    event_id: str | None = None


def check_type(msg: dict[str, Any]) -> str:
    kind = msg.get("type")
    if not isinstance(kind, str):
        raise bad_request("an event needs a string `type`", "type", "invalid_event")
    if kind not in CLIENT_EVENTS:
        raise bad_request(f"type {kind!r}: not an event of a duplex session (it takes "
                          f"{', '.join(CLIENT_EVENTS)})", "type", "unknown_event")
    return kind


def decode_audio(msg: dict[str, Any], max_bytes: int) -> bytes:
    """An append's audio -> PCM16 bytes; 400 for what is not base64 PCM16 or is too large."""
    ev: AppendEvent = parse(AppendEvent, msg, "input_audio_buffer.append")
    if len(ev.audio) > (max_bytes + 2) // 3 * 4:
        raise bad_request(f"audio: a chunk carries at most {max_bytes} bytes of PCM16 "
                          "(send longer audio in several appends)", "audio",
                          "audio_chunk_too_large")
    try:
        pcm = base64.b64decode(ev.audio, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("audio: not base64", "audio", "invalid_audio") from None
    if len(pcm) % 2:
        raise bad_request(f"audio: {len(pcm)} bytes, not whole PCM16 samples (2 bytes each)",
                          "audio", "invalid_audio_format")
    return pcm


def check_update(msg: dict[str, Any], rate: int, model: str) -> None:
    """session.update: only the model's own PCM16 format may be asked for."""
    ev: UpdateEvent = parse(UpdateEvent, msg, "session.update")
    if ev.session.model is not None and ev.session.model != model:
        raise APIError(404, f"session.model: the model {ev.session.model!r} is not served "
                            f"here ({model!r} is)", param="session.model",
                       code="model_not_found")
    audio = ev.session.audio or AudioConfig()
    for name, direction in (("input", audio.input), ("output", audio.output)):
        fmt = direction.format if direction is not None else None
        if fmt is not None and fmt.rate != rate:
            raise bad_request(f"session.audio.{name}.format.rate: {fmt.rate}; this model "
                              f"hears and speaks PCM16 at {rate} Hz only",
                              f"session.audio.{name}.format.rate", "invalid_audio_format")


def session_json(session_id: str, model: str, rate: int, frame_samples: int, tick_ms: float,
                 max_ticks: int) -> dict[str, Any]:
    fmt = {"type": "audio/pcm", "rate": rate}
    return {"id": session_id, "object": "realtime.session", "type": "realtime",
            "model": model, "output_modalities": ["audio"],
            "audio": {"input": {"format": fmt, "turn_detection": None},
                      "output": {"format": fmt}},
            "duplex": {"tick_ms": tick_ms, "frame_samples": frame_samples,
                       "max_ticks": max_ticks}}


SAMPLING_PARAMS = {"temperature": float, "top_k": int, "audio_temperature": float,
                   "audio_top_k": int, "seed": int}


def sampling_of(query: Any) -> DuplexSampling:
    """The session's sampling from the socket's query parameters (SAMPLING_PARAMS; those not
    given: greedy); a 400 naming the parameter for a value that is not a number of its kind or
    is out of range."""
    values: dict[str, Any] = {}
    for name, kind in SAMPLING_PARAMS.items():
        raw = query.get(name)
        if raw is None:
            continue
        try:
            values[name] = kind(raw)
        except ValueError:
            raise bad_request(f"{name}={raw!r}: not {'an integer' if kind is int else 'a number'}",
                              name) from None
    try:
        return DuplexSampling(**values)
    except ValueError as exc:
        param = str(exc).partition("=")[0]
        raise bad_request(str(exc), param) from None
