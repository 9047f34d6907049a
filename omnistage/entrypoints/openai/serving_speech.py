"""POST /v1/audio/speech (OpenAI's) and /v1/audio/speech/batch, for models whose family
declares speech (`registry.SpeechSpec`); any other model answers 400 `model_not_speech`.

A request becomes one engine request: the text as the prompt, and who speaks in the entry
stage's `SamplingParams.extra` (the contract with the model, registry.SpeechSpec):

    voice: preset name       -> extra["voice"]               (none given: the first preset)
    voice: uploaded name     -> extra["ref_audio"], extra["ref_text"] (the stored clip)
    ref_audio (+ ref_text)   -> extra["ref_audio"] = {"samples": float32 LE mono bytes,
                                                      "sample_rate": int}, extra["ref_text"]
                                (a voice sent along is ignored: the clip wins)
    voices: [name|clip, ...] -> extra["voices"] = [ref_audio's dict, ...]: one per speaker of
                                a multi-speaker model's script (SpeechSpec.speakers > 1)
    instructions, language   -> extra["instructions"], extra["language"]
    max_new_tokens           -> the entry stage's max_tokens (the talker's codec frames)

vLLM-Omni's `task_type` and `x_vector_only_mode` are read first (speech_task.py). Every check
runs before the engine sees the request (a 4xx with OpenAI's error JSON). `response_format`
defaults to mp3 (OpenAI's), or wav (vLLM-Omni's) for a request with a field only vLLM-Omni
sends or on a server answering in its dialect (`ServerConfig.vllm_omni_answers`).
`stream_format: audio` (the default) streams the file as the model speaks (chunked; the pieces
are one file, a wav's header says "length unknown"); `sse` (or vLLM-Omni's `stream: true`
without a `stream_format`) sends `speech.audio.delta` events with base64 pieces of that file,
then `speech.audio.done` with the usage. `speed` other than 1.0 is
refused: the models speak at their own pace.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from torch import Tensor

from omnistage.engine.request import OmniRequest, RequestFields
from omnistage.entrypoints.openai.client import (EngineClient, RequestHandle, failed,
                                                 unless_disconnected)
from omnistage.entrypoints.openai.errors import APIError, bad_request
from omnistage.entrypoints.openai.media import MediaLoader, decode_b64
from omnistage.entrypoints.openai.protocol_speech import (VLLM_OMNI_FIELDS, SpeechBatchItem,
                                                          SpeechBatchRequest,
                                                          SpeechBatchResponse,
                                                          SpeechBatchResult, SpeechRequest,
                                                          SpeechVoice)
from omnistage.entrypoints.openai.serving_chat import DEFAULT_SAMPLE_RATE, audio_of
from omnistage.entrypoints.openai.speech_task import check_clone_mode, resolve_task
from omnistage.entrypoints.openai.streaming import ClosingStream, EventStream, sse, sse_error
from omnistage.entrypoints.openai.voices import MAX_UPLOAD_BYTES, VoiceStore, check_clip
from omnistage.outputs import OmniOutput
from omnistage.registry import SpeechSpec
from omnistage.utils.audio import MIME, AudioEncoder, encode_audio

ENCODING = {"mp3": "mp3", "opus": "opus", "aac": "aac", "flac": "flac", "wav": "wav",
            "pcm": "pcm16"}    # the API's format names -> utils/audio.py's


class SpeechServing:
    def __init__(self, client: EngineClient, media: MediaLoader, spec: SpeechSpec | None,
                 voices: VoiceStore) -> None:
        self.client = client
        self.media = media
        self.spec = spec
        self.voices = voices

    # -- checks ----------------------------------------------------------------------------------
    def require_speech(self) -> SpeechSpec:
        if self.spec is None:
            raise bad_request("this model does not make speech: /v1/audio/speech and the voice "
                              "routes are served by text-to-speech models (e.g. Qwen3-TTS)",
                              "model", "model_not_speech")
        return self.spec

    def check_text(self, text: str, param: str = "input") -> str:
        spec = self.require_speech()
        if not text.strip():
            raise bad_request(f"{param}: the text to speak is empty", param, "empty_input")
        if len(text) > spec.max_input_chars:
            raise bad_request(f"{param}: the text is {len(text)} characters; this model speaks "
                              f"at most {spec.max_input_chars} per request", param,
                              "input_too_long")
        return text

    @staticmethod
    def check_speed(speed: float, param: str = "speed") -> None:
        if speed != 1.0:
            raise bad_request(f"{param}={speed}: only 1.0 is supported (the model speaks at its "
                              "own pace)", param, "unsupported_speed")

    async def extra(self, v: SpeechVoice, where: str = "") -> dict[str, Any]:
        """Who speaks and how, as `SamplingParams.extra` (the module docstring's table);
        `where` prefixes the params named in errors (a batch item's "items[2].")."""
        spec = self.require_speech()
        v = resolve_task(v, spec, where)          # after it, voice and ref_audio are not both set
        extra: dict[str, Any] = {}
        if v.voices is not None:
            extra["voices"] = await self._voices(v, where)
        elif v.ref_audio is not None:
            extra.update(await self._clip(v.ref_audio, v.ref_text, f"{where}ref_audio"))
        elif v.voice is not None:
            extra.update(await self._named_voice(v.voice, f"{where}voice"))
        elif spec.voices and v.task_type != "VoiceDesign":
            extra["voice"] = spec.voices[0]
        elif not (spec.voice_design and v.instructions):
            raise bad_request(f"{where}voice: this model has no preset voices; "
                              + ("describe one in instructions, or " if spec.voice_design
                                 else "") + "clone one (ref_audio or an uploaded voice)",
                              f"{where}voice", "voice_required")
        if v.ref_text is not None and "ref_audio" not in extra:
            raise bad_request(f"{where}ref_text: only with ref_audio", f"{where}ref_text")
        if v.instructions is not None:
            if not (spec.instructions or spec.voice_design):
                raise bad_request(f"{where}instructions: this model takes no instructions",
                                  f"{where}instructions", "unsupported_instructions")
            extra["instructions"] = v.instructions
        if v.language is not None:
            if spec.languages and v.language.lower() not in spec.languages:
                raise bad_request(f"{where}language: {v.language!r} is not one of "
                                  f"{', '.join(spec.languages)}", f"{where}language",
                                  "unsupported_language")
            extra["language"] = v.language.lower()
        return check_clone_mode(v, extra, where)

    async def _voices(self, v: SpeechVoice, where: str) -> list[dict[str, Any]]:
        """`voices`: one clip per speaker of a multi-speaker model's script (registry.SpeechSpec
        .speakers), each an uploaded voice's name or a clip (base64 or a URL), as
        SamplingParams.extra["voices"]: {"samples", "sample_rate"} each."""
        spec, param = self.require_speech(), f"{where}voices"
        assert v.voices is not None
        if spec.speakers < 2:
            raise bad_request(f"{param}: this model speaks one voice per request: name it in "
                              "voice" + (" (or send ref_audio)" if spec.cloning else ""), param,
                              "unsupported_voices")
        if len(v.voices) > spec.speakers:
            raise bad_request(f"{param}: {len(v.voices)} voices; this model's scripts have at "
                              f"most {spec.speakers} speakers", param)
        for other in ("voice", "ref_audio", "ref_text"):
            if getattr(v, other) is not None:
                raise bad_request(f"{where}{other}: give voices (one per speaker) or {other}, "
                                  "not both", f"{where}{other}")
        clips = []
        for i, entry in enumerate(v.voices):
            if ":" in entry or len(entry) > 64:          # a clip: a URL or base64
                clips.append((await self._clip(entry, None, f"{param}[{i}]"))["ref_audio"])
                continue
            named = await self._named_voice(entry, f"{param}[{i}]")
            if "ref_audio" not in named:
                raise bad_request(f"{param}[{i}]: {entry!r} is a preset; voices takes uploaded "
                                  "voices or clips", f"{param}[{i}]")
            clips.append(named["ref_audio"])
        return clips

    async def _named_voice(self, voice: str, param: str) -> dict[str, Any]:
        spec = self.require_speech()
        preset = next((p for p in spec.voices if p.lower() == voice.lower()), None)
        if preset is not None:
            return {"voice": preset}
        stored = await run_in_threadpool(self.voices.get, voice)
        if stored is None:
            raise bad_request(f"{param}: {voice[:80]!r} is unknown (presets: "
                              f"{', '.join(spec.voices) or 'none'}; uploaded voices: GET "
                              "/v1/audio/voices)", param, "voice_not_found")
        if not spec.cloning:
            raise bad_request(f"{param}: {voice!r} is an uploaded voice, and this model does not "
                              "clone voices", param, "cloning_not_supported")
        return stored.clip_extra()

    async def _clip(self, ref_audio: str, ref_text: str | None, param: str) -> dict[str, Any]:
        """A reference clip sent with the request: base64, or a URL the media policy allows
        (a data: URL always)."""
        if not self.require_speech().cloning:
            raise bad_request(f"{param}: this model does not clone voices", param,
                              "cloning_not_supported")
        if ":" in ref_audio:
            data = await run_in_threadpool(self.media.fetch, ref_audio, param)
        else:
            if len(ref_audio) * 3 // 4 > MAX_UPLOAD_BYTES:
                raise APIError(413, f"{param}: more than {MAX_UPLOAD_BYTES} bytes", param=param,
                               code="audio_too_large")
            data = decode_b64(ref_audio, param)
        samples, rate = await self.client.run(check_clip, data, param)
        return {"ref_audio": {"samples": samples.astype("<f4").tobytes(), "sample_rate": rate},
                "ref_text": ref_text}

    # -- the engine ------------------------------------------------------------------------------
    async def start(self, text: str, voice: Callable[[], Awaitable[dict[str, Any]]],
                    param: str = "input", max_new_tokens: tuple[str, int | None] | None = None
                    ) -> RequestHandle:
        """Submit one text through the front door: a slot in the queue first, then who
        speaks (`voice()`: a reference clip is decoded only once admitted), its params (the
        graph's defaults, that extra on the entry stages, `max_new_tokens`: (its field, the
        cap) as their max_tokens) and the engine's checks (on the preparation pool)."""
        cap = max_new_tokens if max_new_tokens and max_new_tokens[1] is not None else None

        async def make() -> list[OmniRequest]:
            fields = RequestFields(entry={"max_tokens": cap[1]} if cap else {},
                                   entry_extra=await voice())
            return [self.client.request(text, fields, {"audio"}, "speech", param=param,
                                        max_tokens=cap)]

        [handle] = await self.client.start(make, 1)
        return handle

    def rate_of(self, out: OmniOutput) -> int:
        return out.sample_rate or self.client.engine.audio_sample_rate or DEFAULT_SAMPLE_RATE

    # -- routes ----------------------------------------------------------------------------------
    @staticmethod
    def response_format(req: SpeechRequest, request: Request) -> str:
        """The format asked for; else wav for a request that says it is vLLM-Omni's (a field
        only it sends) or on a server answering in its dialect, mp3 (OpenAI's) otherwise."""
        if req.response_format is not None:
            return req.response_format
        config = getattr(request.app.state, "config", None)
        vllm = bool(req.model_fields_set & VLLM_OMNI_FIELDS) or getattr(
            config, "vllm_omni_answers", False)
        return "wav" if vllm else "mp3"

    async def create(self, req: SpeechRequest, request: Request) -> Response:
        text = self.check_text(req.input)
        self.check_speed(req.speed)
        fmt = self.response_format(req, request)
        handle = await self.start(text, lambda: self.extra(req), "input",
                                  ("max_new_tokens", req.max_new_tokens))
        closers = [handle.close]
        await self.client.open_stream(request, [handle], closers, "input")
        if (req.stream_format or ("sse" if req.stream else "audio")) == "sse":
            return EventStream(self._sse(handle, fmt), closers)
        # a failure after the 200 went out drops the connection: the client sees a cut body
        return ClosingStream(self.encoded(handle, fmt), closers, MIME[ENCODING[fmt]])

    async def waves(self, handle: RequestHandle) -> AsyncIterator[tuple[Tensor, int]]:
        """The request's audio chunks (waveform, rate) as the model makes them; the APIError
        of a request that fails on the way."""
        async for out in handle.outputs():
            if failed(out):
                raise self.client.failure(out, "input")
            audio = audio_of(out.delta_tensors, self.rate_of(out))
            if audio is not None:
                yield audio

    async def encoded(self, handle: RequestHandle, fmt: str) -> AsyncIterator[bytes]:
        """The request's audio as pieces of one file in `fmt`, as the model speaks."""
        enc = AudioEncoder(ENCODING[fmt], self.rate_of(handle.out))
        async for wave, _ in self.waves(handle):
            data = await run_in_threadpool(enc.encode, wave)
            if data:
                yield data
        tail = await run_in_threadpool(enc.close)
        if tail:
            yield tail

    async def _sse(self, handle: RequestHandle, fmt: str) -> AsyncIterator[str]:
        try:
            async for data in self.encoded(handle, fmt):
                yield sse({"type": "speech.audio.delta",
                           "audio": base64.b64encode(data).decode("ascii")})
        except APIError as err:
            yield sse_error(err)
            return
        out = handle.out
        n_in = len(out.prompt_token_ids) or out.metrics.num_prompt_tokens
        n_out = out.metrics.num_output_tokens
        yield sse({"type": "speech.audio.done", "usage": {
            "input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}})

    async def batch(self, req: SpeechBatchRequest, request: Request) -> SpeechBatchResponse:
        """Each item checked on its own (a bad one gets its error in its place), the good
        ones run together; the queue admits all of them or answers 429."""
        self.require_speech()
        self.check_speed(req.speed)
        results: list[SpeechBatchResult] = []
        started: list[tuple[int, RequestHandle]] = []
        try:
            for i, item in enumerate(req.items):
                try:
                    started.append((i, await self._start_item(req, item, i)))
                except APIError as err:
                    if err.status == 429 or err.status >= 500:
                        raise
                    results.append(SpeechBatchResult(index=i, error=err.body()["error"]))
            done = await unless_disconnected(request, lambda: asyncio.gather(
                *(self._whole(i, h, req.response_format) for i, h in started)))
        finally:
            for _, handle in started:
                handle.close()
        return SpeechBatchResponse(data=sorted([*results, *done], key=lambda r: r.index))

    async def _start_item(self, req: SpeechBatchRequest, item: SpeechBatchItem, i: int
                          ) -> RequestHandle:
        text = self.check_text(item.input, f"items[{i}].input")
        if item.voice is None and item.ref_audio is None and item.voices is None \
                and req.voice is not None:
            item = item.model_copy(update={"voice": req.voice})
        return await self.start(text, lambda: self.extra(item, f"items[{i}]."),
                                f"items[{i}].input",
                                (f"items[{i}].max_new_tokens", item.max_new_tokens))

    async def _whole(self, i: int, handle: RequestHandle, fmt: str) -> SpeechBatchResult:
        last: OmniOutput | None = None
        async for out in handle.outputs():
            last = out
        assert last is not None and last.finished
        if failed(last):
            err = self.client.failure(last, f"items[{i}].input")
            if err.param and not err.param.startswith("items["):   # a stage's: the item's field
                err.param = f"items[{i}].{err.param}"
            return SpeechBatchResult(index=i, error=err.body()["error"])
        audio = audio_of(last.outputs[0].tensors, self.rate_of(last))
        wave, rate = audio if audio is not None else (None, self.rate_of(last))
        if wave is None:
            return SpeechBatchResult(index=i, error=APIError(
                500, "the model made no audio", code="engine_error").body()["error"])
        data = await run_in_threadpool(encode_audio, wave, rate, ENCODING[fmt])
        return SpeechBatchResult(index=i, audio=base64.b64encode(data).decode("ascii"),
                                 format=fmt, sample_rate=rate,
                                 duration_s=round(wave.shape[-1] / rate, 4))
