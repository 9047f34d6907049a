"""The Realtime protocol's shapes, as the GA version the `openai` client speaks names them
(openai/types/realtime/): the session a client configures with `session.update`, the
`response.create` options, conversation items, and the JSON of every server event.

Client input is validated here with pydantic (unknown fields refused, each error naming its
field); server events are plain dicts built by `event()`, each with its own `event_id`.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag,
                      ValidationError)

from omnistage.entrypoints.openai.errors import APIError, bad_request, invalid
from omnistage.entrypoints.openai.json_body import check_values, parse_json

# A session that declares no input rate sends OpenAI's: `pcm16` / `audio/pcm` is PCM16 mono at
# 24 kHz (the GA API takes only 24000). Another declared rate (8 to 48 kHz) is an extension.
# Either way the buffer holds the audio resampled to the model's own rate, LISTEN_RATE.
DEFAULT_INPUT_RATE = 24000
LISTEN_RATE = 16000      # what the model hears: Qwen3-Omni's audio encoder listens at 16 kHz
OUTPUT_RATE = 24000      # the protocol's output rate (and Qwen3-Omni's code2wav)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PCMFormat(_Strict):
    """PCM16 mono little-endian; the rate is the client's (we resample to and from it)."""
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: int = Field(DEFAULT_INPUT_RATE, ge=8000, le=48000)


class ServerVad(_Strict):
    type: Literal["server_vad"] = "server_vad"
    threshold: float = Field(0.5, gt=0.0, lt=1.0)
    silence_duration_ms: int = Field(500, ge=32, le=10000)
    prefix_padding_ms: int = Field(300, ge=0, le=5000)
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: None = None                 # not supported: null only


class SemanticVad(_Strict):
    """The end of a turn judged from what was said (turn.py): `eagerness` sets how long the
    server waits at most once the user is silent (low 8 s, medium / auto 4 s, high 2 s)."""
    type: Literal["semantic_vad"] = "semantic_vad"
    eagerness: Literal["low", "medium", "high", "auto"] = "auto"
    create_response: bool = True
    interrupt_response: bool = True


def _vad_tag(value: Any) -> str:
    """A turn_detection's member by its `type` (none given: server_vad, as before); the tags
    are class names, so that an error's param names the field, not the tag."""
    if isinstance(value, (ServerVad, SemanticVad)):
        kind: object = value.type
    else:
        kind = value.get("type", "server_vad") if isinstance(value, dict) else None
    return {"server_vad": "ServerVad", "semantic_vad": "SemanticVad"}.get(str(kind), "-")


TurnDetection = Annotated[Annotated[ServerVad, Tag("ServerVad")]
                          | Annotated[SemanticVad, Tag("SemanticVad")], Discriminator(
                              _vad_tag, custom_error_type="turn_detection_type",
                              custom_error_message="type: 'server_vad', 'semantic_vad' or null")]


class AudioInput(_Strict):
    format: PCMFormat = PCMFormat()
    turn_detection: TurnDetection | None = ServerVad()
    transcription: None = None                   # the model hears the audio itself
    noise_reduction: None = None


class AudioOutput(_Strict):
    format: PCMFormat = PCMFormat(rate=OUTPUT_RATE)
    voice: str | None = None                     # None: the model's own voice
    speed: float = Field(1.0, ge=1.0, le=1.0)    # only the model's own pace


class AudioConfig(_Strict):
    input: AudioInput = AudioInput()
    output: AudioOutput = AudioOutput()


class TokenLimits(_Strict):
    post_instructions: int | None = Field(None, ge=1)   # the items' budget (truncation.py)


class RetentionRatio(_Strict):
    """Truncation that drops more than it must: the oldest items go until the rest use only
    `retention_ratio` of the post-instruction budget, so the next turns grow into the room
    left, each served from the prefix cache, before the next cut (truncation.py)."""
    type: Literal["retention_ratio"]
    retention_ratio: float = Field(ge=0.0, le=1.0)
    token_limits: TokenLimits | None = None


Truncation = Literal["auto", "disabled"] | RetentionRatio


class Session(_Strict):
    """`session.update`'s `session` (merged into the current one, field by field)."""
    type: Literal["realtime"] = "realtime"
    id: str = Field(default_factory=lambda: new_id("sess"))
    object: Literal["realtime.session"] = "realtime.session"
    model: str | None = None
    instructions: str = ""
    output_modalities: list[Literal["text", "audio"]] = Field(["audio"], min_length=1,
                                                              max_length=1)
    audio: AudioConfig = AudioConfig()
    max_output_tokens: int | Literal["inf"] = "inf"
    tools: list[Any] = Field([], max_length=0)   # no tool calling here
    tool_choice: Literal["auto", "none"] = "auto"
    truncation: Truncation = "auto"                # what a prompt over the context drops


class ResponseOptions(_Strict):
    """`response.create`'s `response`: overrides of the session for one response."""
    instructions: str | None = None
    output_modalities: list[Literal["text", "audio"]] | None = Field(None, min_length=1,
                                                                     max_length=1)
    max_output_tokens: int | Literal["inf"] | None = None
    conversation: Literal["auto"] = "auto"       # out-of-band responses are not supported
    metadata: dict[str, str] | None = None
    audio: dict[str, Any] | None = None          # {"output": {"voice": ...}}
    tools: list[Any] = Field([], max_length=0)
    tool_choice: Literal["auto", "none"] = "auto"


class ContentPart(_Strict):
    type: Literal["input_text", "input_audio", "text", "output_text", "output_audio"]
    text: str | None = None
    audio: str | None = None                     # base64 PCM16 at the session's input rate
    transcript: str | None = None


class Item(_Strict):
    """`conversation.item.create`'s item: a message (function calls are not supported)."""
    id: str | None = None
    type: Literal["message"] = "message"
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None
    role: Literal["user", "assistant", "system"]
    content: list[ContentPart] = Field(min_length=1)


def parse(model: type[BaseModel], body: object, param: str) -> Any:
    """Validate `body` as `model`; a failure is a 400 naming the field under `param`."""
    try:
        return model.model_validate(body if body is not None else {})
    except ValidationError as exc:
        err = invalid(list(exc.errors()))
        if err.param:                        # the message starts with the field's name
            err.message, err.param = f"{param}.{err.message}", f"{param}.{err.param}"
        else:
            err.param = param
        raise err from None


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`update` over `base`, objects merged key by key (a null replaces, and so does an
    object of another `type`: server_vad's fields are not semantic_vad's)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) \
                and value.get("type", out[key].get("type")) == out[key].get("type"):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(err: APIError, client_event_id: str | None = None) -> dict[str, Any]:
    body = err.body()["error"]
    return event("error", error={**body, "event_id": client_event_id})


def max_tokens(value: int | str) -> int | None:
    """The protocol's "inf" or a count 1..4096 -> the engine's max_tokens (None: its own)."""
    if value == "inf":
        return None
    if not 1 <= int(value) <= 4096:
        raise bad_request(f"max_output_tokens={value}: must be 1..4096 or \"inf\"",
                          "max_output_tokens")
    return int(value)


def client_event(raw: str | None) -> dict[str, Any]:
    """A text frame as a client event, under the app's one JSON policy (json_body.py: no
    NaN / Infinity, integers within 64 bits, no lone surrogates, bounded nesting), so the
    socket takes what the HTTP routes take; a refusal is a 400 naming the field."""
    if raw is None:                                         # a binary frame
        raise bad_request("an event must be a JSON object with a type, sent as a text frame",
                          None, "invalid_json")
    msg = parse_json(raw)
    if not isinstance(msg, dict):
        raise bad_request("an event must be a JSON object with a type", None, "invalid_json")
    return msg


def event_id_of(msg: dict[str, Any] | None, raw: str | None) -> str | None:
    """The client's `event_id`, for the error event answering it. For an event the policy
    refused, read leniently from the frame, and echoed only if it is itself a clean string."""
    if msg is None and raw is not None:
        try:
            msg = json.loads(raw)
        except (ValueError, RecursionError):
            return None
    event_id = msg.get("event_id") if isinstance(msg, dict) else None
    if not isinstance(event_id, str):
        return None
    try:
        check_values(event_id)
    except APIError:
        return None
    return event_id
