"""POST /v1/chat/completions.

What the answer holds follows from `modalities` and what the served graph's final stages make:

    graph finals      modalities           the answer
    text              [text] (default)     message.content (stream: delta.content)
    text + audio      [text, audio]        message.audio {data, transcript} (stream: delta.content
                                           for text, delta.audio.data for pcm16 chunks)
    image             [image] (default)    message.content = image_url parts (data: PNG URLs)

Image, audio and video parts are loaded and checked here (media.py). A model with an input
processor (Qwen3-Omni) gets the messages with their media as `{"messages": [...]}` and applies
its own template; a text model's messages go through the tokenizer's chat template here (text
only); for an image model the last user message's text is the prompt and its image, if any,
the start of an image-to-image request (DiffusionParams.image).

Audio from the engine: the audio final stage's tensor "audio", float in [-1, 1], (num_samples,)
or (channels, num_samples), chunk by chunk; its rate in tensor "sample_rate" (a scalar) or
`DEFAULT_SAMPLE_RATE`. The voice goes to every AR stage as `SamplingParams.extra["speaker"]`
(Qwen3-Omni's talker reads it; an unknown one is a 400 naming audio.voice).
"""

from __future__ import annotations

import base64
import dataclasses
import time
import uuid
from typing import Any, AsyncIterator, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from torch import Tensor

from omnistage.entrypoints.openai.client import (EngineClient, RequestHandle, failed,
                                                 unless_disconnected)
from omnistage.entrypoints.openai.errors import APIError, bad_request
from omnistage.entrypoints.openai.media import MediaLoader
from omnistage.entrypoints.openai.params import openai_sampling_fields, stage_params
from omnistage.entrypoints.openai.protocol import (AudioData, ChatChoice, ChatChunkChoice,
                                                   ChatCompletionChunk, ChatCompletionRequest,
                                                   ChatCompletionResponse, ChatMessage,
                                                   ChoiceLogprobs, DeltaMessage, ResponseMessage,
                                                   TokenLogprob, TopLogprob, Usage)
from omnistage.entrypoints.openai.streaming import DONE, EventStream, sse, sse_comment, sse_error
from omnistage.outputs import CompletionOutput, OmniOutput
from omnistage.sampling_params import SamplingParams
from omnistage.utils.audio import encode_audio_b64, to_pcm16
from omnistage.utils.images import encode_image_b64

DEFAULT_SAMPLE_RATE = 24000
AUDIO_TTL_S = 3600
# OpenAI sampling fields that mean nothing to an image model
_TEXT_ONLY = ("temperature", "top_p", "stop", "presence_penalty", "frequency_penalty", "top_k",
              "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
              "max_tokens", "max_completion_tokens")


def audio_of(tensors: dict[str, Tensor], default_rate: int | None = None
             ) -> tuple[Tensor, int] | None:
    """The waveform and rate in a final output's tensors, if any (the rate: a "sample_rate"
    tensor, else what the model reported at start-up, else DEFAULT_SAMPLE_RATE)."""
    wave = tensors.get("audio")
    if wave is None:
        return None
    rate = tensors.get("sample_rate")
    if rate is not None:
        return wave, int(rate.flatten()[0])
    return wave, default_rate or DEFAULT_SAMPLE_RATE


class ChatServing:
    def __init__(self, client: EngineClient, media: MediaLoader, model_name: str,
                 chat_template: str | None = None) -> None:
        self.client = client
        self.media = media
        self.model_name = model_name
        self.chat_template = chat_template

    async def create(self, req: ChatCompletionRequest, request: Request
                     ) -> ChatCompletionResponse | Response:
        self._check_unsupported(req)
        wanted = self._modalities(req)
        if "image" in wanted:
            prompt, image = await self._image_prompt(req.messages)
            entry = self._image_fields(req)
        else:
            image = None
            prompt = await self._text_prompt(req)
            max_tokens = req.max_completion_tokens or req.max_tokens
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            entry = openai_sampling_fields(req, max_tokens, logprobs)
        # image models: the picture in the last user message makes it image-to-image
        params = stage_params(self.client.graph, self.client.entry, entry,
                              req.sampling_params_list, image)
        if req.audio is not None:
            params = [dataclasses.replace(p, extra={**p.extra, "speaker": req.audio.voice})
                      if isinstance(p, SamplingParams) else p for p in params]
        try:
            prepared = self.client.prepare(prompt, params, "messages")
        except APIError as err:
            raise _voice_param(err) from None
        ticket = self.client.admit(req.n)       # n completions: n requests in the engine
        try:
            handle = self.client.submit(prompt, prepared, wanted, "chatcmpl")
        except BaseException:
            ticket.release()
            raise
        if req.stream:
            closers = [handle.close, ticket.release]
            try:
                await self.client.open_stream(request, [handle], closers, "messages")
            except APIError as err:
                raise _voice_param(err) from None
            return EventStream(self._stream(req, handle, wanted), closers)
        try:
            return await unless_disconnected(request, lambda: self._full(req, handle))
        finally:
            handle.close()
            ticket.release()

    # -- checks ----------------------------------------------------------------------------------
    def _check_unsupported(self, req: ChatCompletionRequest) -> None:
        for name, off in (("tools", []), ("tool_choice", "none")):
            if getattr(req, name) not in (None, off):
                raise bad_request(f"{name}: tool calling is not supported by this server", name)
        if req.response_format and req.response_format.get("type") != "text":
            raise bad_request("response_format: only {\"type\": \"text\"} is supported",
                              "response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs: needs logprobs: true", "top_logprobs")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options: only allowed with stream: true", "stream_options")

    def _modalities(self, req: ChatCompletionRequest) -> set[str]:
        can = self.client.outputs
        default = ["text"] if "text" in can else ["image"] if "image" in can else ["text"]
        wanted = set(req.modalities or default)
        for kind in sorted(wanted):
            if kind not in can:
                raise bad_request(f"modalities: this model cannot produce {kind} (it produces "
                                  f"{', '.join(sorted(can)) or 'nothing a chat can return'})",
                                  "modalities", "unsupported_modality")
        if "image" in wanted and len(wanted) > 1:
            raise bad_request("modalities: image output cannot be combined with others",
                              "modalities")
        if "audio" in wanted:
            if req.audio is None:
                raise bad_request("audio: required with modalities [\"text\", \"audio\"] "
                                  "({\"voice\": ..., \"format\": ...})", "audio")
            if req.stream and req.audio.format != "pcm16":
                raise bad_request(f"audio.format={req.audio.format!r}: streamed audio is "
                                  "pcm16 (as with OpenAI); use pcm16 or stream: false",
                                  "audio.format")
        elif req.audio is not None:
            raise bad_request("audio: only with modalities [\"text\", \"audio\"]", "audio")
        return wanted

    def _image_fields(self, req: ChatCompletionRequest) -> dict[str, Any]:
        for name in _TEXT_ONLY + ("logprobs",):
            if getattr(req, name) not in (None, False):
                raise bad_request(f"{name}: does not apply to an image model (set image "
                                  "parameters in sampling_params_list)", name)
        if req.n != 1:
            raise bad_request(f"n={req.n}: one choice per request; ask for more images with "
                              "sampling_params_list [{\"num_images\": N}]", "n")
        return {"seed": req.seed} if req.seed is not None else {}

    # -- prompts ---------------------------------------------------------------------------------
    async def _load(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        return await run_in_threadpool(self._load_messages, messages)

    def _load_messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """Messages as chat-template dicts: content a string when it is all text, else parts
        with their media loaded and checked: {"type": "image", "image": PIL, "data": bytes},
        {"type": "audio", "audio": (waveform, rate)}, {"type": "video", "video": [PIL],
        "fps": ...}, {"type": "text", "text": ...}."""
        out: list[dict[str, Any]] = []
        for i, msg in enumerate(messages):
            role = "system" if msg.role == "developer" else msg.role
            if msg.content is None:
                if msg.role != "assistant":
                    raise bad_request(f"messages[{i}].content: required for role {msg.role}",
                                      f"messages[{i}].content")
                out.append({"role": role, "content": ""})
                continue
            if isinstance(msg.content, str):
                out.append({"role": role, "content": msg.content})
                continue
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(msg.content):
                param = f"messages[{i}].content[{j}]"
                if part.type == "text":
                    parts.append({"type": "text", "text": part.text})
                elif part.type == "image_url":
                    image, data = self.media.image(part.image_url.url, f"{param}.image_url.url")
                    parts.append({"type": "image", "image": image, "data": data})
                elif part.type == "input_audio":
                    audio = self.media.audio(part.input_audio.data, part.input_audio.format,
                                             f"{param}.input_audio.data")
                    parts.append({"type": "audio", "audio": audio})
                else:
                    frames, fps = self.media.video(part.video_url.url, f"{param}.video_url.url")
                    parts.append({"type": "video", "video": frames, "fps": fps})
            if all(p["type"] == "text" for p in parts):   # plain templates take a string
                out.append({"role": role, "content": "\n".join(p["text"] for p in parts)})
            else:
                out.append({"role": role, "content": parts})
        return out

    async def _text_prompt(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """A multimodal model's processor takes the messages as they are; a text model's
        prompt is its chat template rendered here and tokenized."""
        messages = await self._load(req.messages)
        if self.client.processor is not None:
            if req.chat_template_kwargs:
                raise bad_request("chat_template_kwargs: not supported for this model",
                                  "chat_template_kwargs")
            for m in messages:
                if isinstance(m["content"], list):
                    for part in m["content"]:
                        part.pop("data", None)
            return {"messages": messages}
        media = sorted({p["type"] for m in messages if isinstance(m["content"], list)
                        for p in m["content"]} - {"text"})
        if media:
            raise bad_request(f"messages: this model takes text only, not {'/'.join(media)}",
                              "messages", "unsupported_input")
        tokenizer = self.client.tokenizer
        if tokenizer is None:
            raise bad_request("this model has no tokenizer, so it cannot chat; use "
                              "/v1/completions with token ids", "messages", "no_tokenizer")
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise bad_request("this model has no chat template (start the server with "
                              "--chat-template FILE); /v1/completions takes raw prompts",
                              "messages", "no_chat_template")
        kwargs = dict(req.chat_template_kwargs or {})
        for reserved in ("conversation", "messages", "tokenize", "chat_template", "return_dict"):
            if reserved in kwargs:
                raise bad_request(f"chat_template_kwargs.{reserved}: set by the server",
                                  f"chat_template_kwargs.{reserved}")
        kwargs.setdefault("add_generation_prompt", messages[-1]["role"] != "assistant")
        try:
            text = tokenizer.apply_chat_template(messages, chat_template=template,
                                                 tokenize=False, **kwargs)
        except Exception as exc:  # jinja errors, raise_exception() in the template, ...
            raise bad_request(f"messages: the chat template failed: {type(exc).__name__}: "
                              f"{exc}", "messages", "chat_template_error") from None
        return {"prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}

    async def _image_prompt(self, messages: list[ChatMessage]) -> tuple[str, bytes | None]:
        """An image model draws what the last user message says, starting from the image in
        it if there is one."""
        loaded = await self._load(messages)
        users = [i for i, m in enumerate(loaded) if m["role"] == "user"]
        if not users:
            raise bad_request("messages: an image model draws what the last user message "
                              "says; there is none", "messages")
        content = loaded[users[-1]]["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        text = "\n".join(p["text"] for p in parts if p["type"] == "text")
        images = [p["data"] for p in parts if p["type"] == "image"]
        other = sorted({p["type"] for p in parts} - {"text", "image"})
        param = f"messages[{users[-1]}].content"
        if other:
            raise bad_request(f"{param}: an image model takes text and one image, not "
                              f"{'/'.join(other)}", param, "unsupported_input")
        if len(images) > 1:
            raise bad_request(f"{param}: one input image at most, got {len(images)}", param)
        if not text.strip():
            raise bad_request(f"{param}: an image model needs text saying what to draw", param)
        return text, (images[0] if images else None)

    # -- answers ---------------------------------------------------------------------------------
    async def _full(self, req: ChatCompletionRequest, handle: RequestHandle
                    ) -> ChatCompletionResponse:
        last: OmniOutput | None = None
        async for out in handle.outputs():
            last = out
        assert last is not None and last.finished
        if failed(last):
            raise self._failure(last)
        choices = [await self._choice(req, c) for c in last.outputs]
        return ChatCompletionResponse(id=handle.request_id, model=self.model_name,
                                      usage=_usage(last), choices=choices)

    async def _choice(self, req: ChatCompletionRequest, c: CompletionOutput) -> ChatChoice:
        """Choice `c.index`: one of the request's n completions."""
        message = ResponseMessage(content=c.text)
        images = c.tensors.get("images")
        if images is not None:
            message.content = await run_in_threadpool(_image_parts, images)
        audio = audio_of(c.tensors, self.client.engine.audio_sample_rate)
        if audio is not None and req.audio is not None:
            wave, rate = audio
            data = await run_in_threadpool(encode_audio_b64, wave, rate, req.audio.format)
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
        audio_id = f"audio-{uuid.uuid4().hex[:16]}"

        def chunk(delta: DeltaMessage, finish: str | None = None,
                  logprobs: ChoiceLogprobs | None = None, index: int = 0) -> str:
            return sse(ChatCompletionChunk(
                id=handle.request_id, created=created, model=self.model_name,
                choices=[ChatChunkChoice(index=index, delta=delta, finish_reason=finish,
                                         logprobs=logprobs)]))

        for i in range(req.n):   # each choice's chunks carry its index (as OpenAI's)
            yield chunk(DeltaMessage(role="assistant", content=""), index=i)
        last: OmniOutput | None = None
        ended: set[int] = set()
        async for out in handle.outputs():
            last = out
            if failed(out):
                yield sse_error(self._failure(out))
                yield DONE
                return
            for c in out.outputs:
                if c.delta_text or (req.logprobs and c.delta_token_ids):
                    lp = None
                    if req.logprobs and c.delta_token_ids:
                        new = (c.logprobs or [])[-len(c.delta_token_ids):]
                        lp = ChoiceLogprobs(content=self._logprobs(c.delta_token_ids, new))
                    yield chunk(DeltaMessage(content=c.delta_text), logprobs=lp, index=c.index)
                audio = (audio_of(c.delta_tensors, self.client.engine.audio_sample_rate)
                         if "audio" in wanted else None)
                if audio is not None:
                    data = await run_in_threadpool(_pcm16_b64, audio[0])
                    yield chunk(DeltaMessage(audio={"id": audio_id, "data": data}),
                                index=c.index)
                if c.finished and c.index not in ended:
                    ended.add(c.index)
                    async for line in self._end_choice(c, wanted, audio_id, chunk):
                        yield line
            if out.progress is not None and not out.finished and "image" in wanted:
                yield sse_comment(f"progress {out.progress:.2f}")
        assert last is not None
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse(ChatCompletionChunk(id=handle.request_id, created=created,
                                          model=self.model_name, choices=[],
                                          usage=_usage(last)))
        yield DONE

    async def _end_choice(self, c: CompletionOutput, wanted: set[str], audio_id: str,
                          chunk: Callable[..., str]) -> AsyncIterator[str]:
        """A finished choice's last chunks: its images, its audio's transcript, its finish."""
        images = c.tensors.get("images")
        if images is not None:
            parts = await run_in_threadpool(_image_parts, images)
            yield chunk(DeltaMessage(content=parts), index=c.index)
        if "audio" in wanted:
            yield chunk(DeltaMessage(audio={"id": audio_id, "transcript": c.text,
                                            "expires_at": int(time.time()) + AUDIO_TTL_S}),
                        index=c.index)
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

