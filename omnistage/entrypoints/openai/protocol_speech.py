"""Request and response bodies of text to speech: /v1/audio/speech (one text or a batch),
the voices, the speech WebSocket's session (strict, as every request in protocol.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from omnistage.entrypoints.openai.protocol import Request

# ---- text to speech (/v1/audio/speech, voices, the WebSocket session) --------------------

SpeechFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
MAX_BATCH_ITEMS = 32


class SpeechVoice(Request):
    """Who speaks, and how: shared by the speech request, a batch item and a WebSocket
    session. `voice` is a preset or an uploaded voice; `ref_audio` (base64, or a data: URL) with
    its transcript `ref_text` clones a voice for this request only (extensions, as `language`)."""

    voice: str | None = Field(None, max_length=64)
    instructions: str | None = Field(None, max_length=4096)
    language: str | None = Field(None, max_length=32)
    ref_audio: str | None = None
    ref_text: str | None = Field(None, max_length=4096)


class SpeechRequest(SpeechVoice):
    model: str | None = None
    input: str
    response_format: SpeechFormat = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"


class SpeechBatchItem(SpeechVoice):
    input: str


class SpeechBatchRequest(Request):
    """Several texts in one call; `voice` (and the format) apply to each item that names none."""

    model: str | None = None
    items: list[SpeechBatchItem] = Field(min_length=1, max_length=MAX_BATCH_ITEMS)
    voice: str | None = Field(None, max_length=64)
    response_format: SpeechFormat = "wav"
    speed: float = Field(1.0, ge=0.25, le=4.0)


class SpeechBatchResult(BaseModel):
    """One item's answer: its audio (base64 file in `format`), or OpenAI's error object."""

    index: int
    audio: str | None = None
    format: SpeechFormat | None = None
    sample_rate: int | None = None
    duration_s: float | None = None
    error: dict[str, Any] | None = None


class SpeechBatchResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[SpeechBatchResult]


class SpeechSession(SpeechVoice):
    """The WebSocket's `session.update`: the voice and the audio format for the session."""

    model: str | None = None
    response_format: SpeechFormat = "pcm"
    speed: float = Field(1.0, ge=0.25, le=4.0)


class VoiceCard(BaseModel):
    name: str
    type: Literal["preset", "uploaded"]
    transcript: str | None = None
    created_at: int | None = None
    duration_s: float | None = None


class VoiceList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VoiceCard]
