"""POST /v1/chat/completions.

What the answer holds follows from `modalities` and what the served graph's final stages make:

    graph finals      modalities           the answer
    text              [text] (default)     message.content (stream: delta.content)
    text + audio      [text, audio]        message.content null, message.audio {id, data,
                                           expires_at, transcript}; streamed: delta.audio
                                           pieces (transcript, pcm16 data, expires_at)
    image             [image] (default)    message.content = image_url parts (data: PNG URLs)
    text + image      [text, image]        a text part, then the image_url parts (BAGEL);
                                           streamed: text deltas, then the image parts
    video             [video] (default)    message.content = a video_url part (data: MP4 URL)

That is OpenAI's shape: with speech the text is the transcript, and `content` stays null.
Without `modalities` the answer is text (OpenAI's default: text clients keep working on an omni
model, and the talker and code2wav do not run), unless the server was started with other
`default_modalities`. `audio` (voice, format) may be left out: the model's own voice, wav
(pcm16 when streamed, the only streamed format, as with OpenAI). A request in vLLM-Omni's
form (chat_dialect.py) gets vLLM-Omni's answer instead: an omni model speaks by default, and
the text and the audio come as two choices (streamed: chunks tagged with their `modality`).
Images and videos: chat_media_out.py; a video model's request is planned as /v1/videos'.

Prompts are built by chat_prompt.py. Audio from the engine: the audio final stage's tensor
"audio", float in [-1, 1], (num_samples,) or (channels, num_samples), chunk by chunk; its rate
in tensor "sample_rate" (a scalar) or `DEFAULT_SAMPLE_RATE`. The voice (`audio.voice`, or
vLLM-Omni's `speaker`) goes to every AR stage as `SamplingParams.extra["speaker"]` (Qwen3-Omni's
talker reads it; an unknown one is a 400 naming the field it came in); on a model that clones
(registry.SpeechSpec.cloning: MiMo-Audio), an uploaded voice's name goes instead as its clip,
`ref_audio` and `ref_text` in the entry stage's extra, as /v1/audio/speech sends it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from torch import Tensor

from omnistage.engine.request import OmniRequest, RequestFields
from omnistage.entrypoints.openai.chat_checks import check_diffusion, check_unsupported
from omnistage.entrypoints.openai.chat_deltas import (
    Piece,
    SpeechDeltas,
    TextDeltas,
    TwoChoiceDeltas,
)
from omnistage.entrypoints.openai.chat_dialect import split_spoken, vllm_form
from omnistage.entrypoints.openai.chat_media_out import (
    image_parts,
    video_fields,
    video_parts,
)
from omnistage.entrypoints.openai.chat_prompt import ChatPrompts
from omnistage.entrypoints.openai.client import (
    EngineClient,
    RequestHandle,
    failed,
    unless_disconnected,
)
from omnistage.entrypoints.openai.errors import APIError, bad_request
from omnistage.entrypoints.openai.media import MediaLoader
from omnistage.entrypoints.openai.params import openai_sampling_fields
from omnistage.entrypoints.openai.protocol import (
    AudioData,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    DeltaMessage,
    ImagePart,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from omnistage.entrypoints.openai.streaming import (
    DONE,
    EventStream,
    sse,
    sse_comment,
    sse_error,
)
from omnistage.entrypoints.openai.video_params import VideoLimits
from omnistage.entrypoints.openai.voices import VoiceStore
from omnistage.entrypoints.openai.vllm_fields import (
    diffusion_fields,
    refuse_on_text_model,
)
from omnistage.outputs import CompletionOutput, OmniOutput
from omnistage.payloads import AudioChunk
from omnistage.utils.audio import encode_audio_b64

DEFAULT_SAMPLE_RATE = 24000
AUDIO_TTL_S = 3600
PICTURES = frozenset({"image", "video"})      # what a diffusion model's chat answers with


def audio_of(tensors: dict[str, Tensor], default_rate: int | None = None
             ) -> tuple[Tensor, int] | None:
    """The waveform and rate in an output's tensors, if any (the rate: the AudioChunk's,
    else what the model reported at start-up, else DEFAULT_SAMPLE_RATE)."""
    audio = AudioChunk.unpack(tensors)
    if audio is None or audio.samples is None:
        return None
    return audio.samples, audio.sample_rate or default_rate or DEFAULT_SAMPLE_RATE


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """What one request's answer holds: the finals it asks for, the speech's format (None:
    no speech), whether speech comes as vLLM-Omni's second choice, a video's frame rate."""

    wanted: frozenset[str]
    fmt: str | None = None
    split: bool = False
    fps: float | None = None


class ChatServing:
    def __init__(self, client: EngineClient, media: MediaLoader, model_name: str,
                 chat_template: str | None = None,
                 default_modalities: tuple[str, ...] = (), *,
                 vllm_omni_answers: bool = False,
                 video_limits: VideoLimits | None = None,
                 voices: VoiceStore | None = None) -> None:
        self.client = client
        self.voices = voices          # a cloning model's uploads: audio.voice may name one
        self.model_name = model_name
        self.prompts = ChatPrompts(client, media, chat_template)
        missing = sorted(set(default_modalities) - client.outputs)
        if missing:
            raise ValueError(f"default_modalities: this model cannot produce {missing[0]} (it "
                             f"produces {', '.join(sorted(client.outputs))})")
        self.default_modalities = default_modalities
        self.vllm_omni_answers = vllm_omni_answers
        self.video_limits = video_limits or VideoLimits()

    async def create(self, req: ChatCompletionRequest, request: Request
                     ) -> ChatCompletionResponse | Response:
        check_unsupported(req)
        plan, entry = self._plan(req)
        self.prompts.check(req.messages, image_model=bool(plan.wanted & PICTURES))
        try:     # n completions: n slots in the queue; the prompt is made on the pool
            [handle] = await self.client.start(lambda: [self._request(req, plan, entry)],
                                               req.n)
        except APIError as err:
            raise _voice_param(err, req) from None
        if req.stream:
            closers = [handle.close]
            try:
                await self.client.open_stream(request, [handle], closers, "messages")
            except APIError as err:
                raise _voice_param(err, req) from None
            return EventStream(self._stream(req, handle, plan), closers)
        try:
            return await unless_disconnected(request, lambda: self._full(req, handle, plan))
        finally:
            handle.close()

    def _plan(self, req: ChatCompletionRequest) -> tuple[ChatPlan, dict[str, Any]]:
        """The answer's plan and the entry fields, every check that needs no media done."""
        vllm = vllm_form(req, self.vllm_omni_answers)
        wanted, split = self._modalities(req, vllm)
        fmt = self._audio_format(req, wanted, vllm)
        if "video" in wanted:
            check_diffusion(req, "video")
            spec = self.client.engine.video
            assert spec is not None, "a graph with a video final serves a video family"
            fields = video_fields(req, spec, self.video_limits, _has_image(req))
            return ChatPlan(frozenset(wanted), fps=fields["fps"]), fields
        if "image" in wanted:
            check_diffusion(req, "image")
            fields = diffusion_fields(req)     # vLLM-Omni's names (vllm_fields.py)
            entry = {**fields, "seed": req.seed} if req.seed is not None else fields
        else:
            entry = self._text_fields(req)
        return ChatPlan(frozenset(wanted), fmt, split), entry

    def _request(self, req: ChatCompletionRequest, plan: ChatPlan, entry: dict[str, Any]
                 ) -> OmniRequest:
        """On the preparation pool: the prompt (media loaded, template rendered) and the
        request record; the front door then runs the engine's checks of both."""
        images: list[bytes] = []
        self.prompts.check_think(req)
        if plan.wanted & PICTURES:
            prompt, images = self.prompts.image_prompt(req.messages)
        else:
            prompt = self.prompts.text_prompt(req)
        # image models: the pictures in the last user message make it image-to-image (or an
        # edit); more than the model takes are refused by the engine's checks, naming `image`
        voice = req.audio.voice if req.audio is not None else req.speaker
        clone = self.voices.clone_extra(voice) if self.voices and voice else None
        fields = RequestFields(entry, req.sampling_params_list, tuple(images),
                               voice=None if clone else voice, entry_extra=clone or {},
                               image_fields="video" in plan.wanted or len(plan.wanted) > 1
                               and "image" in plan.wanted)   # text + image: AR's own defaults
        # a picture's progress shows in a stream as comments
        return self.client.request(prompt, fields, set(plan.wanted), "chatcmpl",
                                   param="messages", max_tokens=_max_tokens(req),
                                   want_progress=req.stream and bool(plan.wanted & PICTURES))

    # -- checks ----------------------------------------------------------------------------------
    def _text_fields(self, req: ChatCompletionRequest) -> dict[str, Any]:
        refuse_on_text_model(req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return openai_sampling_fields(req, max_tokens, logprobs)

    def _modalities(self, req: ChatCompletionRequest, vllm: bool) -> tuple[set[str], bool]:
        """The finals asked for, and whether speech comes as a second choice (vLLM-Omni's
        form, the text asked for too)."""
        can = self.client.outputs
        default = (list(self.default_modalities)
                   or (["text", "audio"] if vllm and {"text", "audio"} <= can else [])
                   or [next((m for m in ("text", "image", "video") if m in can), "text")])
        asked = set(req.modalities or default)
        for kind in sorted(asked):
            if kind not in can:
                raise bad_request(f"modalities: this model cannot produce {kind} (it produces "
                                  f"{', '.join(sorted(can)) or 'nothing a chat can return'})",
                                  "modalities", "unsupported_modality")
        # text then an image in one message (BAGEL's think mode: its plan, then the image)
        if asked & PICTURES and len(asked) > 1 and asked != {"text", "image"}:
            raise bad_request(f"modalities: {'/'.join(sorted(asked & PICTURES))} output cannot "
                              "be combined with others", "modalities")
        wanted = set(asked)
        if "audio" in asked and "text" in can:
            wanted.add("text")        # ["audio"] too: speech comes with its transcript
        return wanted, vllm and {"text", "audio"} <= asked

    def _audio_format(self, req: ChatCompletionRequest, wanted: set[str], vllm: bool
                      ) -> str | None:
        """The format speech is sent in (None: no speech): what `audio.format` says, else wav,
        or pcm16 when streamed in OpenAI's shape (vLLM-Omni's streams a file per chunk)."""
        if "audio" not in wanted:
            for name, given in (("audio", req.audio), ("speaker", req.speaker)):
                if given is not None:
                    raise bad_request(f"{name}: only when the answer speaks (modalities "
                                      "[\"text\", \"audio\"])", name)
            return None
        if req.audio is not None and req.audio.voice is not None and req.speaker is not None:
            raise bad_request("speaker: the voice is given twice (audio.voice and speaker); "
                              "give one", "speaker")
        fmt = req.audio.format if req.audio is not None else None
        if req.stream and not vllm and fmt not in (None, "pcm16"):
            raise bad_request(f"audio.format={fmt!r}: streamed audio is pcm16 (as with "
                              "OpenAI); use pcm16 or stream: false", "audio.format")
        return fmt or ("pcm16" if req.stream and not vllm else "wav")

    # -- answers ---------------------------------------------------------------------------------
    async def _full(self, req: ChatCompletionRequest, handle: RequestHandle, plan: ChatPlan
                    ) -> ChatCompletionResponse:
        last: OmniOutput | None = None
        async for out in handle.outputs():
            last = out
        assert last is not None and last.finished
        if failed(last):
            raise self._failure(last, req)
        choices = [await self._choice(req, c, plan) for c in last.outputs]
        if plan.split:
            choices = split_spoken(choices, req.n)
        return ChatCompletionResponse(id=handle.request_id, model=self.model_name,
                                      usage=_usage(last), choices=choices)

    async def _choice(self, req: ChatCompletionRequest, c: CompletionOutput, plan: ChatPlan
                      ) -> ChatChoice:
        """Choice `c.index`: one of the request's n completions."""
        message = ResponseMessage(content=c.text)
        parts = await self._pictures(c, plan)
        if parts is not None:   # after the text, when the answer has both
            message.content = [{"type": "text", "text": c.text}, *parts] if c.text else parts
        if plan.fmt is not None:  # OpenAI's shape: the text is the transcript, content null
            rate = self.client.engine.audio_sample_rate
            wave, rate = (audio_of(c.tensors, rate)
                          or (torch.zeros(0), rate or DEFAULT_SAMPLE_RATE))   # no speech made
            data = await run_in_threadpool(encode_audio_b64, wave, rate, plan.fmt)
            message.audio = AudioData(id=f"audio-{uuid.uuid4().hex[:16]}", data=data,
                                      expires_at=int(time.time()) + AUDIO_TTL_S,
                                      transcript=c.text)
            message.content = None
        logprobs = (ChoiceLogprobs(content=self._logprobs(c.token_ids, c.logprobs or []))
                    if req.logprobs else None)
        return ChatChoice(index=c.index, message=message, finish_reason=_finish(c),
                          logprobs=logprobs)

    async def _pictures(self, c: CompletionOutput, plan: ChatPlan
                        ) -> list[dict[str, Any]] | None:
        """A finished completion's images or video as content parts (None: it has none)."""
        images = c.pixels
        if images is not None:
            return await run_in_threadpool(image_parts, images)
        video = c.video
        if video is not None:
            assert plan.fps is not None, "a video request's plan has its fps"
            return await run_in_threadpool(video_parts, video, plan.fps)
        return None

    def _writer(self, req: ChatCompletionRequest, plan: ChatPlan, index: int) -> TextDeltas:
        if "audio" not in plan.wanted:
            return TextDeltas(index)
        if plan.split:
            assert plan.fmt is not None
            return TwoChoiceDeltas(index, req.n, plan.fmt)
        return SpeechDeltas(index, f"audio-{uuid.uuid4().hex[:16]}", AUDIO_TTL_S)

    async def _stream(self, req: ChatCompletionRequest, handle: RequestHandle,
                      plan: ChatPlan) -> AsyncIterator[str]:
        created = int(time.time())
        # each choice has a writer of its pieces (chat_deltas.py): OpenAI's text or speech
        # shape, or vLLM-Omni's two choices
        writers = {i: self._writer(req, plan, i) for i in range(req.n)}

        def chunk(piece: Piece) -> str:
            return sse(ChatCompletionChunk(
                id=handle.request_id, created=created, model=self.model_name,
                modality=piece.modality,
                choices=[ChatChunkChoice(index=piece.index, delta=piece.delta,
                                         finish_reason=piece.finish,
                                         logprobs=piece.logprobs)]))

        for writer in writers.values():   # each choice's chunks carry its index (as OpenAI's)
            for piece in writer.start():
                yield chunk(piece)
        last: OmniOutput | None = None
        ended: set[int] = set()
        async for out in handle.outputs():
            last = out
            if failed(out):
                yield sse_error(self._failure(out, req))
                yield DONE
                return
            for c in out.outputs:
                writer = writers[c.index]
                async for piece in self._choice_deltas(req, c, writer, "audio" in plan.wanted):
                    yield chunk(piece)
                if c.finished and c.index not in ended:
                    ended.add(c.index)
                    parts = await self._pictures(c, plan)
                    if parts is not None:
                        yield chunk(Piece(DeltaMessage(content=parts), c.index))
                    for piece in writer.end(_finish(c)):
                        yield chunk(piece)
            if out.progress is not None and not out.finished and plan.wanted & PICTURES:
                yield sse_comment(f"progress {out.progress:.2f}")
        assert last is not None
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse(ChatCompletionChunk(id=handle.request_id, created=created,
                                          model=self.model_name, choices=[],
                                          usage=_usage(last)))
        yield DONE

    async def _choice_deltas(self, req: ChatCompletionRequest, c: CompletionOutput,
                             writer: TextDeltas, speaks: bool) -> AsyncIterator[Piece]:
        """What one update added to choice `c.index`: its text (the transcript, when it
        speaks in OpenAI's shape) with logprobs, then its new audio."""
        if c.delta_text or (req.logprobs and c.delta_token_ids):
            piece = writer.text(c.delta_text)
            if req.logprobs and c.delta_token_ids:
                new = (c.logprobs or [])[-len(c.delta_token_ids):]
                piece.logprobs = ChoiceLogprobs(content=self._logprobs(c.delta_token_ids, new))
            yield piece
        audio = audio_of(c.delta_tensors, self.client.engine.audio_sample_rate)
        if audio is not None and speaks:
            yield writer.audio(await run_in_threadpool(writer.encode, *audio))

    def _failure(self, out: OmniOutput, req: ChatCompletionRequest) -> APIError:
        return _voice_param(self.client.failure(out, "messages"), req)

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


def _voice_param(err: APIError, req: ChatCompletionRequest) -> APIError:
    """A refusal of the speaker (the engine's name for it) names the field the voice came
    in: audio.voice, or vLLM-Omni's speaker."""
    if err.param == "speaker" and req.speaker is None:
        err.param = "audio.voice"
    return err


def _has_image(req: ChatCompletionRequest) -> bool:
    """Whether the last user message holds an image part (the start of image-to-video)."""
    users = [m for m in req.messages if m.role == "user"]
    content = users[-1].content if users else None
    return isinstance(content, list) and any(isinstance(p, ImagePart) for p in content)


def _usage(out: OmniOutput) -> Usage:
    prompt = len(out.prompt_token_ids) or out.metrics.num_prompt_tokens
    completion = sum(len(c.token_ids) for c in out.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion)


def _finish(out: OmniOutput | CompletionOutput) -> str:
    return "length" if out.finish_reason == "length" else "stop"


def _max_tokens(req: ChatCompletionRequest) -> tuple[str, int] | None:
    """The new-token count the request asked for, and the field it came in."""
    if req.max_completion_tokens is not None:
        return "max_completion_tokens", req.max_completion_tokens
    return ("max_tokens", req.max_tokens) if req.max_tokens is not None else None
