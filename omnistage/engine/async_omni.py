"""`AsyncOmni`: the asynchronous front door. `generate()` is an async iterator of outputs.

Each yielded `OmniOutput` holds the request's totals so far (text, token ids) and what this
update added (`delta_text`, `delta_token_ids`, `delta_tensors`, `delta_audio`); an update that
added nothing is not yielded. The last one has `finished=True`, the concatenated final tensors
(`audio`, `images`), and the metrics of every stage it touched. A request that makes audio has
its `sample_rate` on every one of them.

`SamplingParams(n=N)` fans out here, once for every graph: N requests `<id>-0 .. <id>-N-1`
go through the stages (completion i with `seed + i` when a seed is set), and their events come
back relabelled as completion i of the one request (`out.outputs[i]`), which finishes when all
N have.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Callable


from omnistage import registry
from omnistage.configs.defaults import resolve_graph
from omnistage.configs.schema import GraphConfig, OutputKind
from omnistage.configs.vllm_stage_config import stage_configs_yaml
from omnistage.diffusion_params import DiffusionParams
from omnistage.engine.chat import is_chat, render_chat
from omnistage.engine.engine_args import apply_keywords
from omnistage.engine.inputs import (ParsedPrompt, PromptType, check_params, check_prompt,
                                     load_input_processor, parse_prompt, parse_with_processor)
from omnistage.engine.orchestrator import Orchestrator
from omnistage.engine.request import (OmniRequest, ParamsList, RequestFields, StageParams,
                                      build_request)
from omnistage.errors import InputError
from omnistage.models.loader import resolve_model_path
from omnistage.outputs import CompletionOutput, OmniOutput, RequestEvent, RequestMetrics
from omnistage.sampling_params import SamplingParams
from omnistage.stages.info import StageInfo
from omnistage.stages.voice import voice_of
from omnistage.utils.images import peek_image
from omnistage.utils.logging import quiet_known_noise
from omnistage.utils.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

Sink = Callable[[RequestEvent], None]
Prepared = tuple[ParsedPrompt, dict[str, StageParams]]


class AsyncOmni:
    def __init__(self, model: str | None = None, *, stage_config: str | Path | None = None,
                 stage_overrides: list[str] | tuple[str, ...] = (), device: str = "auto",
                 graph: GraphConfig | None = None, stage_configs_path: str | Path | None = None,
                 **engine_kw: object) -> None:
        """`engine_kw`: vLLM's engine keywords (gpu_memory_utilization, max_model_len, dtype,
        ...) and stage keys, applied as stage overrides (engine_args.py); TypeError on any
        other. `stage_configs_path`: a vLLM-Omni stage config, translated (in place of
        `stage_config`)."""
        quiet_known_noise()   # transformers' warnings about our models' valid configs
        if stage_configs_path is not None:
            if stage_config is not None:
                raise ValueError("stage_config and stage_configs_path both given: pass one")
            stage_config = stage_configs_yaml(stage_configs_path)
        model_path = resolve_model_path(model) if model is not None else None
        if graph is None:
            graph = resolve_graph(str(model_path) if model_path else None, model_path,
                                  stage_config, list(stage_overrides))
            graph = apply_keywords(graph, engine_kw, stage_overrides)
        else:   # a graph given as built: the keywords only
            graph = apply_keywords(graph, engine_kw)
        missing = registry.missing_extras(model_path, graph.backend)
        if missing:   # before any stage starts: one line, not a stage process's traceback
            extras = ",".join(missing)
            raise RuntimeError(
                f"{'backend ray' if missing == ['ray'] else 'this model'} needs omnistage's "
                f"[{extras}] extra, which is not installed: pip install 'omnistage[{extras}]' "
                f"(in a checkout: .venv/bin/pip install -e '.[{extras}]')")
        self.graph = graph
        tokenizer = next((s.ar.tokenizer for s in graph.stages if s.ar and s.ar.tokenizer), None)
        family = registry.match_folder(model_path) if model_path is not None else None
        sub = family.tokenizer if family is not None and family.tokenizer else "."
        self.tokenizer = load_tokenizer(
            Path(tokenizer) if tokenizer else model_path and model_path / sub
            or (Path(graph.model) if graph.model else None))
        # multimodal models: chat templates, audio features, image patches at the front door
        self.processor = load_input_processor(model_path)
        # what the model offers as text to speech (/v1/audio/speech); None: no speech
        self.speech = registry.speech_spec(model_path)
        # what video it makes (/v1/videos); None: none
        self.video = registry.video_spec(model_path)
        self.orchestrator = Orchestrator(graph, device)
        self.entry = [s.name for s in graph.stages if not s.inputs]
        # entry stages that read the prompt as text (diffusion; an AR stage building its own
        # prompt says so in its info: text_prompt), not as token ids
        self.text_entry = any(graph.stage(n).kind == "diffusion"
                              or self.orchestrator.stage_info.get(n, StageInfo()).text_prompt
                              for n in self.entry)
        self._ids = itertools.count()
        self._fan_outs: dict[str, list[str]] = {}   # request id -> its n sub-request ids

    # -- requests ------------------------------------------------------------------------------
    def request(self, prompt: PromptType, params: ParamsList | RequestFields = None, *,
                modalities: set[OutputKind] | frozenset[str] | None = None,
                want_progress: bool = False, request_id: str | None = None,
                **kw: object) -> OmniRequest:
        """The request record (engine/request.py `build_request`, the one way it is made)."""
        return build_request(self.graph, self.entry, prompt, params, modalities=modalities,
                             want_progress=want_progress, request_id=request_id, **kw)

    def prepare(self, request: OmniRequest | PromptType,
                sampling_params_list: ParamsList = None) -> Prepared:
        """Parse and check a request's prompt and its per-stage params; ValueError on bad
        input. `{"messages": [...]}` (chat.py) works for every model with a chat template.
        (A prompt and its params are made into a request first.)"""
        if not isinstance(request, OmniRequest):
            request = self.request(request, sampling_params_list)
        parsed = self._parse(request.prompt)
        for name in self.entry:
            check_prompt(parsed, self.orchestrator.stage_info.get(name, StageInfo()))
        params = request.by_stage(self.graph)
        for name, p in params.items():
            info = self.orchestrator.stage_info.get(name, StageInfo())
            if isinstance(p, SamplingParams):
                check_params(p, info)
                check_speaker(p, info)
            elif isinstance(p, DiffusionParams):
                p.validate()
                check_input_images(p, info)
        self._num_completions(params)
        return parsed, params

    def _parse(self, prompt: PromptType) -> ParsedPrompt:
        if self.processor is not None:
            if is_chat(prompt) and set(prompt) - {"messages"}:
                raise ValueError(f"{min(set(prompt) - {'messages'})}: this model's input "
                                 "processor applies its own chat template; pass messages only")
            return parse_with_processor(prompt, self.processor)
        if is_chat(prompt):
            if self.text_entry:
                raise ValueError("this model draws from a text prompt and takes no chat "
                                 "messages: pass the prompt to generate()")
            return render_chat(prompt, self.tokenizer)
        return parse_prompt(prompt, self.tokenizer, tokenize=not self.text_entry)

    def _num_completions(self, params: dict[str, StageParams]) -> int:
        """`n` of the entry stages' SamplingParams; a request's completions run the whole
        graph, so `n` on any other stage is refused."""
        asked = {name: p.n for name, p in params.items()
                 if isinstance(p, SamplingParams) and p.n != 1}
        for name, n in asked.items():
            if name not in self.entry:
                raise InputError(f"SamplingParams.n={n} on stage {name!r}: n (completions per "
                                 f"prompt) is set on the entry stage's params "
                                 f"({', '.join(self.entry)})", "n")
        if len(set(asked.values())) > 1:
            raise InputError(f"SamplingParams.n differs between entry stages: {asked}", "n")
        return max(asked.values(), default=1)

    def submit(self, prompt: PromptType, sampling_params_list: ParamsList = None,
               request_id: str | None = None, output_modalities: set[OutputKind] | None = None,
               sink: Sink | None = None, prepared: Prepared | None = None) -> OmniOutput:
        """`add_request` of the request these make (the older way in, kept for callers)."""
        assert sink is not None, "submit needs a sink for the request's events"
        request = self.request(prompt, sampling_params_list, modalities=output_modalities,
                               request_id=request_id, want_progress=True)
        return self.add_request(request, sink, prepared)

    def add_request(self, request: OmniRequest, sink: Sink, prepared: Prepared | None = None
                    ) -> OmniOutput:
        """Check (unless `prepared`: what `prepare` returned) and submit; events go to `sink`
        (from the router thread). Returns the output object that `OmniOutput.apply` fills
        in."""
        parsed, params = prepared or self.prepare(request)
        rid = request.request_id or f"{request.prefix}-{uuid.uuid4().hex[:12]}"
        n = self._num_completions(params)
        out = OmniOutput(request_id=rid, prompt=parsed.text,
                         prompt_token_ids=list(parsed.token_ids or []),
                         outputs=[CompletionOutput(index=i) for i in range(n)])
        out.metrics = RequestMetrics(arrival_time=time.time(), num_prompt_tokens=parsed.num_tokens)
        modalities = None if request.modalities is None else set(request.modalities)
        if n == 1:
            stages = self.orchestrator.add_request(
                rid, parsed.token_ids, params, sink, modalities, parsed.embeds, parsed.text,
                parsed.multimodal, want_progress=request.want_progress)
        else:
            stages = self._fan_out(rid, n, parsed, params, sink, modalities,
                                   request.want_progress)
        # only the caller folds events into `out`, after this returns: no race with the router
        out.sample_rate = self._sample_rate(stages)
        for c in out.outputs:
            c.sample_rate = out.sample_rate
        return out

    def _fan_out(self, rid: str, n: int, parsed: ParsedPrompt, params: dict[str, StageParams],
                 sink: Sink, output_modalities: set[OutputKind] | None,
                 want_progress: bool) -> set[str]:
        """Submit completion i as request `<rid>-i` with `seed + i`; its events reach `sink`
        as the parent's, tagged with the index. All or none are submitted."""
        subs = [f"{rid}-{i}" for i in range(n)]
        left = [n]
        lock = threading.Lock()

        def relay(i: int) -> Sink:
            def put(ev: RequestEvent) -> None:
                ev.request_id, ev.index = rid, i
                if ev.done:
                    with lock:
                        left[0] -= 1
                        if left[0] == 0:
                            self._fan_outs.pop(rid, None)
                sink(ev)
            return put

        self._fan_outs[rid] = subs
        stages: set[str] = set()
        try:
            for i, sub in enumerate(subs):
                stages = self.orchestrator.add_request(
                    sub, parsed.token_ids, completion_params(params, i), relay(i),
                    output_modalities, parsed.embeds, parsed.text, parsed.multimodal,
                    want_progress=want_progress)
        except BaseException:
            self._fan_outs.pop(rid, None)
            for sub in subs:
                self.orchestrator.abort(sub)
            raise
        return stages

    async def generate(self, prompt: PromptType | OmniRequest,
                       sampling_params_list: ParamsList = None,
                       request_id: str | None = None,
                       output_modalities: set[OutputKind] | None = None, *,
                       want_progress: bool = False) -> AsyncIterator[OmniOutput]:
        """The request's outputs as they come (a prompt and its params are made into a
        request first); progress updates only with `want_progress`."""
        request = prompt if isinstance(prompt, OmniRequest) else self.request(
            prompt, sampling_params_list, modalities=output_modalities,
            want_progress=want_progress, request_id=request_id)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        out = self.add_request(request, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
        try:
            while not out.finished:
                ev = await queue.get()
                snapshot = out.apply(ev)
                # no empty updates: each one adds output, progress, or ends a completion
                if snapshot.has_delta or ev.progress is not None or ev.done:
                    yield snapshot
        finally:
            if not out.finished:  # the caller went away (disconnect, cancel): abort everywhere
                self.abort(out.request_id)

    @property
    def audio_sample_rate(self) -> int | None:
        """Sample rate of the audio the model writes (None: it writes none)."""
        return self._sample_rate({s.name for s in self.graph.stages})

    def _sample_rate(self, stages: set[str]) -> int | None:
        """The rate the first audio final stage among `stages` reported at its ready
        handshake (Ready.info.sample_rate); None if none of them writes audio."""
        for stage in self.graph.stages:
            if stage.name in stages and stage.final == "audio":
                return self.orchestrator.stage_info.get(stage.name, StageInfo()).sample_rate
        return None

    def abort(self, request_id: str) -> None:
        """Abort a request (each of its n completions) in every stage it touched."""
        for sub in self._fan_outs.get(request_id) or [request_id]:
            self.orchestrator.abort(sub)

    @property
    def is_healthy(self) -> bool:
        return self.orchestrator.healthy

    def shutdown(self) -> None:
        self.orchestrator.shutdown()

    async def __aenter__(self) -> AsyncOmni:
        return self

    async def __aexit__(self, *exc: object) -> None:
        """`async with AsyncOmni(...) as engine:` stops every stage process on leaving (the
        shutdown joins them, so it runs on a worker thread: the event loop stays free)."""
        await asyncio.to_thread(self.shutdown)

    def __enter__(self) -> AsyncOmni:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def completion_params(params: dict[str, StageParams], i: int) -> dict[str, StageParams]:
    """Completion i's params: n=1, and `seed + i` wherever a seed is set (completion 0 is
    the request as n=1 would run it)."""
    out: dict[str, StageParams] = {}
    for name, p in params.items():
        if isinstance(p, SamplingParams):
            p = dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + i)
        elif isinstance(p, DiffusionParams) and p.seed is not None:
            p = dataclasses.replace(p, seed=p.seed + i)
        out[name] = p
    return out


def check_input_images(params: DiffusionParams, info: StageInfo) -> None:
    """A diffusion request's input image files: no more than its stage's pipeline takes
    (`max_input_images`, where the stage says), each an image file by its header (the
    diffusion engine decodes them, once)."""
    files = [] if params.image is None else [params.image, *params.extra_images]
    limit = info.max_input_images
    if limit is not None and len(files) > limit:
        raise InputError(f"image: this model takes at most {limit} input image"
                         f"{'s' if limit > 1 else ''}, got {len(files)}", "image")
    for data in files:
        peek_image(data)


def check_speaker(params: SamplingParams, info: StageInfo) -> None:
    """A voice the stage does not know (its info lists `speakers`) is refused, naming the key
    it came under: `voice` or `speaker` (one key: stages/voice.py)."""
    speaker = voice_of(params.extra)
    key = "voice" if params.extra.get("voice") is not None else "speaker"
    known = info.speakers
    if speaker is not None and known and str(speaker).lower() not in known:
        raise InputError(f"speaker {speaker!r} is unknown (this model has: "
                         f"{', '.join(known)})", param=key)
