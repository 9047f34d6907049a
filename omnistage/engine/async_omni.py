"""`AsyncOmni`: the asynchronous front door. `generate()` is an async iterator of outputs.

Each yielded `OmniOutput` holds the request's totals so far (text, token ids) and what this
update added (`delta_text`, `delta_token_ids`, `delta_tensors`, `delta_audio`); the last one has
`finished=True`, the concatenated final tensors (`audio`, `images`), and the metrics of every
stage it touched. A request that makes audio has its `sample_rate` on every one of them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Callable

import torch

from omnistage.configs.defaults import resolve_graph
from omnistage.configs.schema import GraphConfig, OutputKind
from omnistage.diffusion.image_input import decode_image
from omnistage.diffusion.params import DiffusionParams
from omnistage.engine.inputs import (ParsedPrompt, PromptType, check_params, check_prompt,
                                     load_input_processor, parse_prompt, parse_with_processor)
from omnistage.engine.orchestrator import Orchestrator
from omnistage.errors import InputError
from omnistage.models.loader import resolve_model_path
from omnistage.outputs import OmniOutput, RequestEvent, RequestMetrics
from omnistage.sampling_params import SamplingParams
from omnistage.utils.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

StageParams = SamplingParams | DiffusionParams | None
ParamsList = SamplingParams | DiffusionParams | list[StageParams] | None


class AsyncOmni:
    def __init__(self, model: str | None = None, *, stage_config: str | Path | None = None,
                 stage_overrides: list[str] | tuple[str, ...] = (), device: str = "auto",
                 graph: GraphConfig | None = None, **engine_kw: object) -> None:
        model_path = resolve_model_path(model) if model is not None else None
        if graph is None:
            graph = resolve_graph(str(model_path) if model_path else None, model_path,
                                  stage_config, list(stage_overrides), **engine_kw)
        self.graph = graph
        tokenizer = next((s.tokenizer for s in graph.stages if s.tokenizer), None)
        self.tokenizer = load_tokenizer(Path(tokenizer) if tokenizer else model_path
                                        or (Path(graph.model) if graph.model else None))
        # multimodal models: chat templates, audio features, image patches at the front door
        self.processor = load_input_processor(model_path)
        self.orchestrator = Orchestrator(graph, device)
        self.entry = [s.name for s in graph.stages if not s.inputs]
        # entry stages that read the prompt as text (diffusion), not as token ids
        self.text_entry = any(graph.stage(n).kind == "diffusion" for n in self.entry)
        self._ids = itertools.count()

    # -- requests ------------------------------------------------------------------------------
    def prepare(self, prompt: PromptType, sampling_params_list: ParamsList = None
                ) -> tuple[ParsedPrompt, dict[str, StageParams]]:
        """Parse and check a prompt and its per-stage params; ValueError on bad input."""
        if self.processor is not None:
            parsed = parse_with_processor(prompt, self.processor)
        else:
            parsed = parse_prompt(prompt, self.tokenizer, tokenize=not self.text_entry)
        for name in self.entry:
            check_prompt(parsed, self.orchestrator.stage_info.get(name, {}))
        params = self._stage_params(sampling_params_list)
        for name, p in params.items():
            if isinstance(p, SamplingParams):
                info = self.orchestrator.stage_info.get(name, {})
                check_params(p, info)
                speaker = p.extra.get("speaker")
                known = info.get("speakers")
                if speaker is not None and known is not None \
                        and str(speaker).lower() not in str(known).split(","):
                    raise InputError(f"speaker {speaker!r} is unknown (this model has: "
                                     f"{str(known).replace(',', ', ')})", param="speaker")
            elif isinstance(p, DiffusionParams):
                p.validate()
                if p.image is not None:
                    decode_image(p.image)     # an undecodable image is refused here
        return parsed, params

    def _stage_params(self, given: ParamsList) -> dict[str, StageParams]:
        kinds = {s.name: s.kind for s in self.graph.stages}
        wants = {"ar": SamplingParams, "diffusion": DiffusionParams}
        if given is None:
            return dict.fromkeys(kinds)
        if isinstance(given, (SamplingParams, DiffusionParams)):
            # SamplingParams go to the entry stages; DiffusionParams to every diffusion stage
            # (a split graph's text-encoder stage and the denoiser it feeds serve one request)
            pool = self.entry if isinstance(given, SamplingParams) else list(kinds)
            targets = [n for n in pool if wants.get(kinds[n]) is type(given)]
            if not targets:
                raise ValueError(f"{type(given).__name__} given, but no entry stage takes it "
                                 f"(entry stages: {', '.join(self.entry)})")
            return {n: (given if n in targets else None) for n in kinds}
        given = list(given)
        if len(given) != len(kinds):
            raise ValueError(f"sampling_params_list has {len(given)} entries, this model has "
                             f"{len(kinds)} stage{'s' if len(kinds) > 1 else ''} "
                             f"({', '.join(kinds)})")
        for (name, kind), p in zip(kinds.items(), given):
            want = wants.get(kind)
            if p is not None and (want is None or not isinstance(p, want)):
                raise ValueError(f"sampling_params_list entry for stage {name!r} ({kind}) must "
                                 f"be {want.__name__ if want else 'None'} or None, got "
                                 f"{type(p).__name__}")
        return dict(zip(kinds, given))

    def submit(self, prompt: PromptType, sampling_params_list: ParamsList = None,
               request_id: str | None = None, output_modalities: set[OutputKind] | None = None,
               sink: Callable[[RequestEvent], None] | None = None,
               prepared: tuple[ParsedPrompt, dict[str, StageParams]] | None = None
               ) -> OmniOutput:
        """Check and submit; events go to `sink` (from the router thread). Returns the output
        object that `accumulate` fills in. `prepared`: what `prepare` already returned."""
        parsed, params = prepared or self.prepare(prompt, sampling_params_list)
        rid = request_id or f"req-{uuid.uuid4().hex[:12]}"
        out = OmniOutput(request_id=rid, prompt=parsed.text,
                         prompt_token_ids=list(parsed.token_ids or []))
        out.metrics = RequestMetrics(arrival_time=time.time(), num_prompt_tokens=parsed.num_tokens)
        assert sink is not None, "submit needs a sink for the request's events"
        stages = self.orchestrator.add_request(rid, parsed.token_ids, params, sink,
                                               output_modalities, parsed.embeds, parsed.text,
                                               parsed.multimodal)
        # only the caller folds events into `out`, after this returns: no race with the router
        out.sample_rate = self._sample_rate(stages)
        return out

    async def generate(self, prompt: PromptType, sampling_params_list: ParamsList = None,
                       request_id: str | None = None,
                       output_modalities: set[OutputKind] | None = None
                       ) -> AsyncIterator[OmniOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        out = self.submit(prompt, sampling_params_list, request_id, output_modalities,
                          lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
        try:
            while True:
                ev = await queue.get()
                snapshot = accumulate(out, ev)
                yield snapshot
                if ev.done:
                    return
        finally:
            if not out.finished:  # the caller went away (disconnect, cancel): abort everywhere
                self.orchestrator.abort(out.request_id)

    @property
    def audio_sample_rate(self) -> int | None:
        """Sample rate of the audio the model writes (None: it writes none)."""
        return self._sample_rate({s.name for s in self.graph.stages})

    def _sample_rate(self, stages: set[str]) -> int | None:
        """The rate the first audio final stage among `stages` reported at its ready
        handshake (Ready.info["sample_rate"]); None if none of them writes audio."""
        for stage in self.graph.stages:
            if stage.name in stages and stage.final == "audio":
                rate = self.orchestrator.stage_info.get(stage.name, {}).get("sample_rate")
                return None if rate is None else int(rate)
        return None

    def abort(self, request_id: str) -> None:
        self.orchestrator.abort(request_id)

    @property
    def is_healthy(self) -> bool:
        return self.orchestrator.healthy

    def shutdown(self) -> None:
        self.orchestrator.shutdown()


def accumulate(out: OmniOutput, ev: RequestEvent) -> OmniOutput:
    """Fold one event into the request's totals; return a snapshot carrying the deltas."""
    now = time.time()
    m = out.metrics
    if ev.token_ids:
        out.token_ids.extend(ev.token_ids)
        m.first_token_time = m.first_token_time or now
        m.num_output_tokens = len(out.token_ids)
    out.text += ev.text
    if ev.progress is not None:
        out.progress = ev.progress
    if ev.logprobs:
        out.logprobs = (out.logprobs or []) + ev.logprobs
    if ev.tensors:
        m.first_token_time = m.first_token_time or now
        for k, v in ev.tensors.items():
            out.tensor_chunks.setdefault(k, []).append(v)
        rate = ev.tensors.get("sample_rate")
        if rate is not None:   # a stage may send its rate with the samples (the server reads it)
            out.sample_rate = int(rate.flatten()[0])
    if ev.stage_finished and ev.finish_reason and out.finish_reason is None:
        out.finish_reason = ev.finish_reason     # the first final stage to finish says why
    if ev.done:
        out.finished = True
        out.finish_reason = out.finish_reason or ev.finish_reason or "stop"
        if ev.error:
            out.finish_reason, out.error = "error", ev.error
            out.invalid_input, out.error_info = ev.invalid_input, ev.error_info
        if ev.finish_reason == "abort":
            out.finish_reason = "abort"
        m.finished_time = now
        out.stage_metrics = ev.stage_metrics or {}
        for sm in out.stage_metrics.values():
            m.num_cached_tokens += int(sm.get("num_cached_tokens") or 0)
            m.num_preemptions += int(sm.get("num_preemptions") or 0)
            if m.first_scheduled_time is None and sm.get("queue_time") is not None:
                m.first_scheduled_time = sm["arrival_time"] + sm["queue_time"]  # entry stage
        out.tensors = {k: torch.cat(v) for k, v in out.tensor_chunks.items()}
    return out.snapshot(ev)
