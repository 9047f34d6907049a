"""Request and response bodies of text to speech: /v1/audio/speech (one text or a batch),
the voices, the speech WebSocket's session (strict, as every request in protocol.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, computed_field, field_validator

from omnistage.entrypoints.openai.protocol import Request

# ---- text to speech (/v1/audio/speech, voices, the WebSocket session) --------------------

SpeechFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
TaskType = Literal["CustomVoice", "VoiceDesign", "Base"]     # Qwen3-TTS's (vLLM-Omni's field)
MAX_BATCH_ITEMS = 32
MAX_NEW_TOKENS = 4096                  # vLLM-Omni's bound on max_new_tokens
MAX_SPEAKERS = 8                       # `voices`: one a speaker (the model's SpeechSpec caps it)
VLLM_OMNI_FIELDS = frozenset({"task_type", "max_new_tokens", "x_vector_only_mode", "stream"})


class SpeechVoice(Request):
    """Who speaks, and how: shared by the speech request, a batch item and a WebSocket
    session. `voice` is a preset or an uploaded voice (a name, or the OpenAI SDK's custom voice
    object `{"id": name}`); `ref_audio` (base64, or a data: URL) with its transcript `ref_text`
    clones a voice for this request only (extensions, as `language`). vLLM-Omni's extensions:
    `task_type` names the mode (CustomVoice: a preset, VoiceDesign: a voice described in
    `instructions`, Base: a clone) and `x_vector_only_mode` clones from the speaker embedding
    alone, without the transcript (speech_task.py). `voices` (a multi-speaker model's, as
    VibeVoice's) gives each speaker of the script its own voice, in the order the speakers
    first speak: each an uploaded voice's name or a clip (base64, or a data: URL)."""

    voice: str | None = Field(None, max_length=64)
    instructions: str | None = Field(None, max_length=4096)
    language: str | None = Field(None, max_length=32)
    ref_audio: str | None = None
    ref_text: str | None = Field(None, max_length=4096)
    task_type: TaskType | None = None
    x_vector_only_mode: bool | None = None
    voices: list[str] | None = Field(None, min_length=1, max_length=MAX_SPEAKERS)

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_object(cls, value: object) -> object:
        """OpenAI's custom voice object {"id": "voice_1234"} names the voice by its id."""
        if isinstance(value, dict):
            if set(value) != {"id"}:
                raise ValueError('a voice object is {"id": NAME}, with no other key')
            return value["id"]
        return value


class SpeechRequest(SpeechVoice):
    """`response_format` None: the server's default (mp3 as OpenAI's; wav for a request with a
    field only vLLM-Omni sends, or on a server answering in vLLM-Omni's dialect).
    `stream_format` None: `audio`, or `sse` when vLLM-Omni's `stream` is true (its rule)."""

    model: str | None = None
    input: str
    response_format: SpeechFormat | None = None
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] | None = None
    stream: bool = False
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)


class SpeechBatchItem(SpeechVoice):
    input: str
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)


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
    """The WebSocket's `session.update`: the voice and the audio format for the session;
    `max_new_tokens` caps each clause's steps (as on /v1/audio/speech)."""

    model: str | None = None
    response_format: SpeechFormat = "pcm"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)


class VoiceCard(BaseModel):
    name: str
    type: Literal["preset", "uploaded"]
    transcript: str | None = None
    created_at: int | None = None
    duration_s: float | None = None


class VoiceList(BaseModel):
    """Ours (`object`, `data`: one card a voice) and vLLM-Omni's beside it (`voices`: every
    name, `uploaded_voices`: the uploads with `ref_text`, their transcript)."""

    object: Literal["list"] = "list"
    data: list[VoiceCard]

    @computed_field        # type: ignore[prop-decorator]
    @property
    def voices(self) -> list[str]:
        return [card.name for card in self.data]

    @computed_field        # type: ignore[prop-decorator]
    @property
    def uploaded_voices(self) -> list[dict[str, Any]]:
        return [{"name": c.name, "created_at": c.created_at,
                 **({"ref_text": c.transcript} if c.transcript else {})}
                for c in self.data if c.type == "uploaded"]
