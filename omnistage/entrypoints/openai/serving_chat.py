"""POST /v1/chat/completions.

What the answer holds follows from `modalities` and what the served graph's final stages make:

    graph finals      modalities           the answer
    text              [text] (default)     message.content (stream: delta.content)
    text + audio      [text, audio]        message.content null, message.audio {id, data,
                                           expires_at, transcript}; streamed: delta.audio
                                           pieces (transcript, pcm16 data, expires_at)
    image             [image] (default)    message.content = image_url parts (data: PNG URLs)

That is OpenAI's shape: with speech the text is the transcript, and `content` stays null.
Without `modalities` the answer is text (OpenAI's default: text clients keep working on an omni
model, and the talker and code2wav do not run), unless the server was started with other
`default_modalities`. `audio` (voice, format) may be left out: the model's own voice, wav
(pcm16 when streamed, the only streamed format, as with OpenAI).

Prompts are built by chat_prompt.py. Audio from the engine: the audio final stage's tensor
"audio", float in [-1, 1], (num_samples,) or (channels, num_samples), chunk by chunk; its rate
in tensor "sample_rate" (a scalar) or `DEFAULT_SAMPLE_RATE`. The voice goes to every AR stage as
`SamplingParams.extra["speaker"]` (Qwen3-Omni's talker reads it; an unknown one is a 400 naming
audio.voice).
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, AsyncIterator, Callable

import torch
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from torch import Tensor

from omnistage.entrypoints.openai.chat_prompt import ChatPrompts
from omnistage.engine.request import OmniRequest, RequestFields
from omnistage.entrypoints.openai.client import (EngineClient, RequestHandle, failed,
                                                 unless_disconnected)
from omnistage.entrypoints.openai.errors import APIError, bad_request
from omnistage.entrypoints.openai.media import MediaLoader
from omnistage.entrypoints.openai.params import ignore, openai_sampling_fields
from omnistage.entrypoints.openai.protocol import (AudioData, ChatChoice, ChatChunkChoice,
                                                   ChatCompletionChunk, ChatCompletionRequest,
                                                   ChatCompletionResponse, ChoiceLogprobs,
                                                   DeltaMessage, ResponseMessage, TokenLogprob,
                                                   TopLogprob, Usage)
from omnistage.entrypoints.openai.vllm_fields import diffusion_fields, refuse_on_text_model
from omnistage.entrypoints.openai.streaming import (DONE, EventStream, SpeechDeltas, sse,
                                                    sse_comment, sse_error)
from omnistage.outputs import CompletionOutput, OmniOutput
from omnistage.payloads import AudioChunk
from omnistage.utils.audio import encode_audio_b64, to_pcm16
from omnistage.utils.images import encode_image_b64

DEFAULT_SAMPLE_RATE = 24000
AUDIO_TTL_S = 3600
# OpenAI sampling fields that mean nothing to an image model
_TEXT_ONLY = ("temperature", "top_p", "stop", "presence_penalty", "frequency_penalty", "top_k",
              "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
              "max_tokens", "max_completion_tokens")
# OpenAI fields accepted with no effect here, and why
_IGNORED = {"verbosity": "the model decides its own length",
            "service_tier": "one tier here", "safety_identifier": "no abuse monitoring here",
            "prompt_cache_key": "prefix caching needs no key",
            "prompt_cache_retention": "prefix caching keeps what memory allows",
            "store": "this server stores no completions",
            "metadata": "this server stores no completions",
            "user": "no abuse monitoring here"}
# OpenAI fields this server cannot honour: a 400 when set (to other than the "off" value)
_UNSUPPORTED = {"tools": ("tool calling", []), "tool_choice": ("tool calling", "none"),
                "functions": ("function calling", []), "function_call": ("function calling",
                                                                         "none"),
                "prediction": ("predicted outputs", None),
                "web_search_options": ("web search", None)}


def audio_of(tensors: dict[str, Tensor], default_rate: int | None = None
             ) -> tuple[Tensor, int] | None:
    """The waveform and rate in an output's tensors, if any (the rate: the AudioChunk's,
    else what the model reported at start-up, else DEFAULT_SAMPLE_RATE)."""
    audio = AudioChunk.unpack(tensors)
    if audio is None or audio.samples is None:
        return None
    return audio.samples, audio.sample_rate or default_rate or DEFAULT_SAMPLE_RATE


class ChatServing:
    def __init__(self, client: EngineClient, media: MediaLoader, model_name: str,
                 chat_template: str | None = None,
                 default_modalities: tuple[str, ...] = ()) -> None:
        self.client = client
        self.model_name = model_name
        self.prompts = ChatPrompts(client, media, chat_template)
        missing = sorted(set(default_modalities) - client.outputs)
        if missing:
            raise ValueError(f"default_modalities: this model cannot produce {missing[0]} (it "
                             f"produces {', '.join(sorted(client.outputs))})")
        self.default_modalities = default_modalities

    async def create(self, req: ChatCompletionRequest, request: Request
                     ) -> ChatCompletionResponse | Response:
        self._check_unsupported(req)
        wanted = self._modalities(req)
        fmt = self._audio_format(req, wanted)
        entry = self._image_fields(req) if "image" in wanted else self._text_fields(req)
        self.prompts.check(req.messages, image_model="image" in wanted)
        try:     # n completions: n slots in the queue; the prompt is made on the pool
            [handle] = await self.client.start(lambda: [self._request(req, wanted, entry)],
                                               req.n)
        except APIError as err:
            raise _voice_param(err) from None
        if req.stream:
            closers = [handle.close]
            try:
                await self.client.open_stream(request, [handle], closers, "messages")
            except APIError as err:
                raise _voice_param(err) from None
            return EventStream(self._stream(req, handle, wanted), closers)
        try:
            return await unless_disconnected(request, lambda: self._full(req, handle, fmt))
        finally:
            handle.close()

    def _request(self, req: ChatCompletionRequest, wanted: set[str], entry: dict[str, Any]
                 ) -> OmniRequest:
        """On the preparation pool: the prompt (media loaded, template rendered) and the
        request record; the front door then runs the engine's checks of both."""
        images: list[bytes] = []
        if "image" in wanted:
            prompt, images = self.prompts.image_prompt(req.messages)
        else:
            prompt = self.prompts.text_prompt(req)
        # image models: the pictures in the last user message make it image-to-image (or an
        # edit); more than the model takes are refused by the engine's checks, naming `image`
        voice = req.audio.voice if req.audio is not None else None
        fields = RequestFields(entry, req.sampling_params_list, tuple(images), voice=voice)
        # an image's progress shows in a stream as comments
        return self.client.request(prompt, fields, wanted, "chatcmpl", param="messages",
                                   max_tokens=_max_tokens(req),
                                   want_progress=req.stream and "image" in wanted)

    # -- checks ----------------------------------------------------------------------------------
    def _text_fields(self, req: ChatCompletionRequest) -> dict[str, Any]:
        refuse_on_text_model(req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return openai_sampling_fields(req, max_tokens, logprobs)

    def _check_unsupported(self, req: ChatCompletionRequest) -> None:
        for name, (what, off) in _UNSUPPORTED.items():
            if getattr(req, name) not in (None, off):
                raise bad_request(f"{name}: {what} is not supported by this server", name)
        if req.response_format and req.response_format.get("type") != "text":
            raise bad_request("response_format: only {\"type\": \"text\"} is supported",
                              "response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs: needs logprobs: true", "top_logprobs")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options: only allowed with stream: true", "stream_options")
        for name, why in _IGNORED.items():
            if getattr(req, name):         # store: false, metadata: {} ask for nothing
                ignore(name, why)
        for key, value in (req.mm_processor_kwargs or {}).items():
            if key != "use_audio_in_video":
                raise bad_request(f"mm_processor_kwargs.{key}: not a processor option here "
                                  "(known: use_audio_in_video)", f"mm_processor_kwargs.{key}")
            if value is not False:
                raise bad_request("mm_processor_kwargs.use_audio_in_video: a video's audio "
                                  "track is not used here; send it as its own audio part, or "
                                  "pass false", "mm_processor_kwargs.use_audio_in_video")

    def _modalities(self, req: ChatCompletionRequest) -> set[str]:
        can = self.client.outputs
        default = list(self.default_modalities) or (
            ["text"] if "text" in can else ["image"] if "image" in can else ["text"])
        wanted = set(req.modalities or default)
        for kind in sorted(wanted):
            if kind not in can:
                raise bad_request(f"modalities: this model cannot produce {kind} (it produces "
                                  f"{', '.join(sorted(can)) or 'nothing a chat can return'})",
                                  "modalities", "unsupported_modality")
        if "image" in wanted and len(wanted) > 1:
            raise bad_request("modalities: image output cannot be combined with others",
                              "modalities")
        if "audio" in wanted and "text" in can:
            wanted.add("text")        # ["audio"] too: speech comes with its transcript
        return wanted

    def _audio_format(self, req: ChatCompletionRequest, wanted: set[str]) -> str | None:
        """The format speech is sent in (None: no speech): what `audio.format` says, else wav,
        or pcm16 when streamed."""
        if "audio" not in wanted:
            if req.audio is not None:
                raise bad_request("audio: only with modalities [\"text\", \"audio\"]", "audio")
            return None
        fmt = req.audio.format if req.audio is not None else None
        if req.stream and fmt not in (None, "pcm16"):
            raise bad_request(f"audio.format={fmt!r}: streamed audio is pcm16 (as with "
                              "OpenAI); use pcm16 or stream: false", "audio.format")
        return fmt or ("pcm16" if req.stream else "wav")

    def _image_fields(self, req: ChatCompletionRequest) -> dict[str, Any]:
        for name in _TEXT_ONLY + ("logprobs",):
            if getattr(req, name) not in (None, False):
                raise bad_request(f"{name}: does not apply to an image model (set image "
                                  "parameters in sampling_params_list)", name)
        if req.n != 1:
            raise bad_request(f"n={req.n}: one choice per request; ask for more images with "
                              "sampling_params_list [{\"num_images\": N}]", "n")
        fields = diffusion_fields(req)     # vLLM-Omni's names (vllm_fields.py)
        return {**fields, "seed": req.seed} if req.seed is not None else fields

    # -- answers ---------------------------------------------------------------------------------
    async def _full(self, req: ChatCompletionRequest, handle: RequestHandle, fmt: str | None
                    ) -> ChatCompletionResponse:
        last: OmniOutput | None = None
        async for out in handle.outputs():
            last = out
        assert last is not None and last.finished
        if failed(last):
            raise self._failure(last)
        choices = [await self._choice(req, c, fmt) for c in last.outputs]
        return ChatCompletionResponse(id=handle.request_id, model=self.model_name,
                                      usage=_usage(last), choices=choices)

    async def _choice(self, req: ChatCompletionRequest, c: CompletionOutput, fmt: str | None
                      ) -> ChatChoice:
        """Choice `c.index`: one of the request's n completions."""
        message = ResponseMessage(content=c.text)
        images = c.pixels
        if images is not None:
            message.content = await run_in_threadpool(_image_parts, images)
        if fmt is not None:      # OpenAI's shape: the text is the transcript, content null
            rate = self.client.engine.audio_sample_rate
            wave, rate = (audio_of(c.tensors, rate)
                          or (torch.zeros(0), rate or DEFAULT_SAMPLE_RATE))   # no speech made
            data = await run_in_threadpool(encode_audio_b64, wave, rate, fmt)
            message.audio = AudioData(id=f"audio-{uuid.uuid4().hex[:16]}", data=data,
                                      expires_at=int(time.time()) + AUDIO_TTL_S,
                                      transcript=c.text)
            message.content = None
        logprobs = (ChoiceLogprobs(content=self._logprobs(c.token_ids, c.logprobs or []))
                    if req.logprobs else None)
        return ChatChoice(index=c.index, message=message, finish_reason=_finish(c),
                          logprobs=logprobs)

    async def _stream(self, req: ChatCompletionRequest, handle: RequestHandle,
                      wanted: set[str]) -> AsyncIterator[str]:
        created = int(time.time())
        # each choice speaks with its own audio id (OpenAI's delta.audio pieces)
        speech = ({i: SpeechDeltas(f"audio-{uuid.uuid4().hex[:16]}", AUDIO_TTL_S)
                   for i in range(req.n)} if "audio" in wanted else None)

        def chunk(delta: DeltaMessage, finish: str | None = None,
                  logprobs: ChoiceLogprobs | None = None, index: int = 0) -> str:
            return sse(ChatCompletionChunk(
                id=handle.request_id, created=created, model=self.model_name,
                choices=[ChatChunkChoice(index=index, delta=delta, finish_reason=finish,
                                         logprobs=logprobs)]))

        for i in range(req.n):   # each choice's chunks carry its index (as OpenAI's)
            yield chunk(DeltaMessage(role="assistant", content=None if speech else ""),
                        index=i)
        last: OmniOutput | None = None
        ended: set[int] = set()
        async for out in handle.outputs():
            last = out
            if failed(out):
                yield sse_error(self._failure(out))
                yield DONE
                return
            for c in out.outputs:
                voice = speech[c.index] if speech else None
                async for line in self._choice_deltas(req, c, voice, chunk):
                    yield line
                if c.finished and c.index not in ended:
                    ended.add(c.index)
                    async for line in self._end_choice(c, voice, chunk):
                        yield line
            if out.progress is not None and not out.finished and "image" in wanted:
                yield sse_comment(f"progress {out.progress:.2f}")
        assert last is not None
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse(ChatCompletionChunk(id=handle.request_id, created=created,
                                          model=self.model_name, choices=[],
                                          usage=_usage(last)))
        yield DONE

    async def _choice_deltas(self, req: ChatCompletionRequest, c: CompletionOutput,
                             speech: SpeechDeltas | None, chunk: Callable[..., str]
                             ) -> AsyncIterator[str]:
        """What one update added to choice `c.index`: its text (the transcript, when it
        speaks) with logprobs, then its new pcm16 audio."""
        if c.delta_text or (req.logprobs and c.delta_token_ids):
            lp = None
            if req.logprobs and c.delta_token_ids:
                new = (c.logprobs or [])[-len(c.delta_token_ids):]
                lp = ChoiceLogprobs(content=self._logprobs(c.delta_token_ids, new))
            delta = (DeltaMessage(audio=speech.transcript(c.delta_text)) if speech
                     else DeltaMessage(content=c.delta_text))
            yield chunk(delta, logprobs=lp, index=c.index)
        audio = audio_of(c.delta_tensors, self.client.engine.audio_sample_rate)
        if audio is not None and speech is not None:
            data = await run_in_threadpool(_pcm16_b64, audio[0])
            yield chunk(DeltaMessage(audio=speech.data(data)), index=c.index)

    async def _end_choice(self, c: CompletionOutput, speech: SpeechDeltas | None,
                          chunk: Callable[..., str]) -> AsyncIterator[str]:
        """A finished choice's last chunks: its images, its audio's end, its finish."""
        images = c.pixels
        if images is not None:
            parts = await run_in_threadpool(_image_parts, images)
            yield chunk(DeltaMessage(content=parts), index=c.index)
        if speech is not None:
            yield chunk(DeltaMessage(audio=speech.end()), index=c.index)
        yield chunk(DeltaMessage(), finish=_finish(c), index=c.index)

    def _failure(self, out: OmniOutput) -> APIError:
        return _voice_param(self.client.failure(out, "messages"))

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]]
                  ) -> list[TokenLogprob]:
        tok = self.client.tokenizer
        text = (lambda t: tok.decode([t])) if tok is not None else str
        out = []
        for token, top in zip(token_ids, logprobs):
            ranked = sorted(top.items(), key=lambda kv: -kv[1])
            out.append(TokenLogprob(
                token=text(token), logprob=top.get(token, float("-inf")),
                bytes=list(text(token).encode()),
                top_logprobs=[TopLogprob(token=text(t), logprob=lp, bytes=list(text(t).encode()))
                              for t, lp in ranked]))
        return out


def _voice_param(err: APIError) -> APIError:
    """A refusal of the speaker (the engine's name for it) names the request's audio.voice."""
    if err.param == "speaker":
        err.param = "audio.voice"
    return err


def _usage(out: OmniOutput) -> Usage:
    prompt = len(out.prompt_token_ids) or out.metrics.num_prompt_tokens
    completion = sum(len(c.token_ids) for c in out.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion)


def _finish(out: OmniOutput | CompletionOutput) -> str:
    return "length" if out.finish_reason == "length" else "stop"


def _image_parts(images: Tensor) -> list[dict[str, Any]]:
    return [{"type": "image_url",
             "image_url": {"url": f"data:image/png;base64,{encode_image_b64(img, 'png')}"}}
            for img in images]                                      # images: uint8 (n, H, W, C)


def _pcm16_b64(wave: Tensor) -> str:
    return base64.b64encode(to_pcm16(wave)).decode("ascii")


def _max_tokens(req: ChatCompletionRequest) -> tuple[str, int] | None:
    """The new-token count the request asked for, and the field it came in."""
    if req.max_completion_tokens is not None:
        return "max_completion_tokens", req.max_completion_tokens
    return ("max_tokens", req.max_tokens) if req.max_tokens is not None else None
