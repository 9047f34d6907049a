"""Request and response bodies of the OpenAI-compatible routes (pydantic v2).

Requests are strict: an unknown field is a 400 naming it (as OpenAI does), ranges are checked
here so that the error names the field. Every field OpenAI documents for a route is declared:
those this server honours, those it accepts and ignores with a logged warning (`service_tier`,
images' `style`, ...: they change nothing a client could check), and those it cannot honour
(`tools`, `logit_bias`, ...), which answer "not supported" rather than "unknown field".
Extensions beyond OpenAI are vLLM's sampling extras (`top_k`, `min_p`, `ignore_eos`, ...),
vLLM's `audio_url` content part, the image parameters of diffusion models, and
`sampling_params_list`: one dict (or null) per stage of the served graph, fields of that
stage's SamplingParams or DiffusionParams.

Responses follow OpenAI's shapes; fields that are absent in OpenAI's answers stay absent.
Speech (protocol_speech.py) and video (protocol_video.py) have files of their own.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from omnistage.diffusion_params import MAX_LORA_SCALE, LoraRequest
from omnistage.entrypoints.openai.vllm_fields import merge_extra_body

AudioFormat = Literal["wav", "pcm16", "flac", "mp3", "opus"]
ImageFormat = Literal["png", "jpeg", "webp"]
Modality = Literal["text", "audio", "image", "video"]


class Request(BaseModel):
    """Strict: a number sent as a string is refused ("0.5" is no temperature, "1" no
    boolean); a form's fields, text by nature, are validated with strict=False. No NaN or
    infinity from any source (json_body.py refuses them in JSON already)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# ---- shared pieces ---------------------------------------------------------------------------

class LoraBody(Request):
    """vLLM-Omni's per-request `lora` object, with its aliases: the adapter's name, its file
    or folder on the server (loaded on first use; omitted: an adapter already loaded under
    that name), its scale. `int_id` is vLLM's cache id: accepted, the name is ours."""

    name: Annotated[str, Field(min_length=1, max_length=256)] = Field(
        validation_alias=AliasChoices("name", "lora_name", "adapter"))
    path: Annotated[str, Field(min_length=1, max_length=4096)] | None = Field(
        None, validation_alias=AliasChoices("local_path", "path", "lora_path",
                                            "lora_local_path"))
    scale: Annotated[float, Field(ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE)] = Field(
        1.0, validation_alias=AliasChoices("scale", "lora_scale"))
    int_id: int | None = Field(None, validation_alias=AliasChoices("int_id", "lora_int_id"))

    def to_params(self) -> LoraRequest:
        return LoraRequest(self.name, self.path, self.scale)


class StreamOptions(Request):
    include_usage: bool = False


class SamplingExtras(Request):
    """OpenAI's sampling fields shared by chat and completions, plus vLLM's extras."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # omnistage: per-stage parameters, one entry per stage of the served graph
    sampling_params_list: list[dict[str, Any] | None] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# ---- chat ------------------------------------------------------------------------------------

class TextPart(Request):
    type: Literal["text"]
    text: str


class ImageURL(Request):
    url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Request):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(Request):
    data: Annotated[str, Field(min_length=1)]   # base64
    format: Literal["wav", "mp3", "flac"]


class AudioPart(Request):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioURL(Request):
    url: Annotated[str, Field(min_length=1)]


class AudioURLPart(Request):
    """vLLM's audio part: a URL (data:, file: or http(s)) of an audio file in any container."""

    type: Literal["audio_url"]
    audio_url: AudioURL


class VideoURL(Request):
    url: Annotated[str, Field(min_length=1)]
    # vLLM's: this many frames spread evenly over the video (else 2 a second); media.py
    num_frames: Annotated[int, Field(ge=1)] | None = None


class VideoPart(Request):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | AudioPart | AudioURLPart | VideoPart,
                        Field(discriminator="type")]


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ContentPart], Field(min_length=1)] | None = None
    name: str | None = None


class AudioOutput(Request):
    voice: Annotated[str, Field(min_length=1)] | None = None    # None: the model's own voice
    format: AudioFormat | None = None           # None: wav, or pcm16 when streamed


class ChatCompletionRequest(SamplingExtras):
    model: str | None = None         # None: the served model (vLLM-Omni's clients omit it)
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    modalities: Annotated[list[Modality], Field(min_length=1)] | None = None
    audio: AudioOutput | None = None
    # vLLM-Omni's name for the voice (audio.voice); sending it says the client is vLLM-Omni's
    speaker: Annotated[str, Field(min_length=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # honoured through the chat template where it has a switch for it, else ignored (logged)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None \
        = None
    # vLLM-Omni's BAGEL switch (its extra_args `think`): reason before answering, where the
    # model's input processor has a `think_prefix` for the answer's modalities
    think: bool | None = None
    # accepted and ignored, with a logged warning
    verbosity: Literal["low", "medium", "high"] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # declared so that the answer is "not supported" (400) rather than "unknown field"
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # vLLM(-Omni)'s processor switches: use_audio_in_video (a video's audio track interleaved
    # with it, chat_prompt.py); anything else is refused naming the key
    mm_processor_kwargs: dict[str, Any] | None = None
    # vLLM-Omni's diffusion fields (vllm_fields.py maps them to DiffusionParams); a body-level
    # `extra_body` object is merged in before validation
    extra_body: dict[str, Any] | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    true_cfg_scale: float | None = None
    negative_prompt: str | None = None
    num_outputs_per_prompt: int | None = None
    num_frames: int | None = None
    fps: float | None = None
    boundary_ratio: float | None = None
    flow_shift: float | None = None
    lora: LoraBody | None = None        # vLLM-Omni's per-request LoRA adapter (image models)

    @model_validator(mode="before")
    @classmethod
    def _merge_extra_body(cls, data: Any) -> Any:
        return merge_extra_body(data)


class AudioData(BaseModel):
    id: str
    data: str               # base64 of the encoded audio
    expires_at: int
    transcript: str


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | list[dict[str, Any]] | None = None
    audio: AudioData | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaAudio(BaseModel):
    """A piece of streamed speech, as OpenAI sends it: `id` on the first transcript piece and
    the first audio piece, then `transcript` pieces (the text) and `data` pieces (base64
    pcm16), and last a piece with only `expires_at`. Joined, they make message.audio."""

    id: str | None = None
    data: str | None = None
    expires_at: int | None = None
    transcript: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | list[dict[str, Any]] | None = None
    audio: DeltaAudio | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    # vLLM-Omni's two-choice stream only: which output the chunk carries, "text" or "audio"
    # (an audio chunk's delta.content is a base64 audio file); absent in OpenAI's shape
    modality: Literal["text", "audio"] | None = None


# ---- completions -----------------------------------------------------------------------------

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingExtras):
    model: str
    prompt: (Annotated[str, Field(min_length=1)] | TokenIds
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1,
                                                                           max_length=64)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=64)])
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- images ----------------------------------------------------------------------------------

class ImageRequest(Request):
    """The fields /v1/images/generations and /v1/images/edits share."""

    prompt: Annotated[str, Field(min_length=1, max_length=32000)]
    model: str | None = None
    n: Annotated[int, Field(ge=1, le=10)] = 1
    size: str | None = None             # "WxH" or "auto"; checked in params.parse_size
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: ImageFormat = "png"
    output_compression: Annotated[int, Field(ge=0, le=100)] | None = None
    user: str | None = None
    # "transparent" is refused (no model here draws alpha); the others are what it draws
    background: Literal["transparent", "opaque", "auto"] | None = None
    # accepted and ignored, with a logged warning (the number of steps is the quality knob)
    quality: Literal["low", "medium", "high", "xhigh", "max", "auto", "standard", "hd"] | None \
        = None
    safety_identifier: str | None = None
    # declared so that the answer is "not supported" (400) rather than "unknown field"
    stream: bool | None = None
    partial_images: Annotated[int, Field(ge=0, le=3)] | None = None
    # diffusion extras
    negative_prompt: Annotated[str, Field(max_length=32000)] | None = None
    num_inference_steps: Annotated[int, Field(ge=1, le=200)] | None = None
    guidance_scale: Annotated[float, Field(ge=0.0)] | None = None
    true_cfg_scale: Annotated[float, Field(ge=0.0)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    lora: LoraBody | None = None        # vLLM-Omni's per-request LoRA adapter


class ImageGenerationRequest(ImageRequest):
    # accepted and ignored, with a logged warning
    style: Literal["vivid", "natural"] | None = None
    moderation: Literal["low", "auto"] | None = None


class ImageEditRequest(ImageRequest):
    """The form fields of an edit (the files, `image` / `image[]` and `mask`, come apart)."""

    input_fidelity: Literal["high", "low"] | None = None      # ignored, with a warning
    strength: Annotated[float, Field(gt=0.0, le=1.0)] | None = None   # extension


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))
    data: list[ImageData]
    output_format: ImageFormat
    size: str


# ---- models, errors --------------------------------------------------------------------------

class ModelCapabilities(BaseModel):
    """What the served model can do, for a client to choose what to offer (the playground's
    tabs): the routes that serve it and what a chat message may carry."""

    endpoints: list[str]         # e.g. /v1/chat/completions, /v1/images/generations
    input_modalities: list[str]  # text, image, audio, video


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omnistage"
    root: str | None = None
    parent: str | None = None           # a LoRA adapter's: the model it adapts (vLLM's)
    max_model_len: int | None = None
    modalities: list[str] = Field(default_factory=list)   # what the model can output
    capabilities: ModelCapabilities | None = None
    # False: a stage runs the model through the generic diffusers adapter (`backend`
    # "diffusers", `pipeline` its class): diffusers' own code, not an omnistage port
    native: bool = True
    backend: str = "omnistage"
    pipeline: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
