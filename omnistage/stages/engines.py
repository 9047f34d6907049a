"""One face for every stage kind, as the worker sees it: add a request, feed it adapted input,
close its input, abort it, step. Results are kind-neutral `StageResult`s."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import Tensor

from omnistage.ar.engine import AREngine
from omnistage.configs.schema import StageConfig
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipeline import compile_blocks, is_split_pipeline
from omnistage.diffusion.registry import get_pipeline_class
from omnistage.diffusion.text_encoding import TEXT_ENCODER_PART, TextEncodingEngine
from omnistage.engine.adapters import StageFeed
from omnistage.generation.engine import GenerationEngine
from omnistage.generation.registry import get_generation_model_class
from omnistage.sampling_params import SamplingParams
from omnistage.utils.device import resolve_device, resolve_dtype


@dataclass(slots=True)
class StageResult:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    tensors: dict[str, Tensor] = field(default_factory=dict)  # payload for edges / the client
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    engine_metrics: dict[str, float | int | None] | None = None
    progress: float | None = None     # share of the work done (diffusion steps)


class StageEngine(Protocol):
    def add(self, request_id: str, params: SamplingParams | None,
            prompt_token_ids: list[int] | None, prompt_embeds: Tensor | None,
            streamed: bool, arrival_time: float, prompt: str | None = None,
            diffusion: DiffusionParams | None = None, **_: object) -> None: ...
    def feed(self, request_id: str, feed: StageFeed) -> None: ...
    def close_input(self, request_id: str) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def step(self) -> list[StageResult]: ...
    @property
    def has_unfinished_requests(self) -> bool: ...


class ARStage:
    options: frozenset[str] = frozenset()   # the stage options a subclass understands

    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        self.check_options(stage)
        self.stage = stage
        self.engine = AREngine(stage.ar_config(model, device))
        self.defaults = stage.default_sampling()
        # the decode graphs of requests emitting the stage's hidden layers: now, not mid-serving
        self.engine.capture_decode_graphs(stage.output_hidden_layers)

    @classmethod
    def check_options(cls, stage: StageConfig) -> None:
        unknown = set(stage.options) - cls.options
        if unknown:
            known = ", ".join(sorted(cls.options)) or "none"
            raise ValueError(f"stage {stage.name!r}: unknown options {sorted(unknown)} "
                             f"(this stage takes: {known})")

    def add(self, request_id: str, params: SamplingParams | None,
            prompt_token_ids: list[int] | None, prompt_embeds: Tensor | None,
            streamed: bool, arrival_time: float, prompt: str | None = None,
            diffusion: DiffusionParams | None = None, **_: object) -> None:
        params = params or self.defaults
        if self.stage.output_hidden_layers and not params.output_hidden_layers:
            # what the downstream edges need is the stage's business, not the caller's
            params = replace(params, output_hidden_layers=self.stage.output_hidden_layers)
        self.engine.add_request(request_id, prompt_token_ids, params, prompt_embeds,
                                prompt_open=streamed, stream_open=streamed)

    def feed(self, request_id: str, feed: StageFeed) -> None:
        self.engine.extend_request(request_id, feed.prompt_token_ids, feed.prompt_embeds,
                                   feed.close_prompt, feed.stream_embeds, feed.close_stream)

    def close_input(self, request_id: str) -> None:
        self.engine.extend_request(request_id, close_prompt=True, close_stream=True)

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests

    def step(self) -> list[StageResult]:
        results = []
        for out in self.engine.step():
            tensors: dict[str, Tensor] = {}
            if out.new_token_ids:
                tensors["token_ids"] = torch.tensor(out.new_token_ids, dtype=torch.int64)
            if out.hidden_states:
                for layer, h in out.hidden_states.items():
                    tensors[f"hidden.{layer}"] = h
                num_rows = next(iter(out.hidden_states.values())).shape[0]
                tensors["hidden_positions"] = torch.arange(out.hidden_start,
                                                           out.hidden_start + num_rows)
                tensors["num_prompt_tokens"] = torch.tensor(out.num_prompt_tokens)
            engine_metrics = None
            if out.metrics is not None:
                engine_metrics = {"queue_time": out.metrics.queue_time,
                                  "num_prompt_tokens": out.metrics.num_prompt_tokens,
                                  "num_cached_tokens": out.metrics.num_cached_tokens,
                                  "num_preemptions": out.metrics.num_preemptions}
            results.append(StageResult(
                out.request_id, out.new_token_ids, out.text_delta, tensors, out.finished,
                out.finish_reason.value if out.finish_reason else None, out.error,
                out.logprobs, engine_metrics))
        return results


class GenerationStage:
    def __init__(self, stage: StageConfig, model: str | None, device: str) -> None:
        if not stage.component:
            raise ValueError(f"stage {stage.name!r}: a generation stage needs a component")
        dev = resolve_device(device)
        cls = get_generation_model_class(stage.component)
        path = stage.model or model
        dtype = None if stage.dtype == "auto" else resolve_dtype(stage.dtype, None, dev)
        self.engine = GenerationEngine(cls.from_pretrained(path, stage.component, dev, dtype,
                                                           **stage.options),
                                       stage.max_num_seqs)

    def add(self, request_id: str, params: SamplingParams | None,
            prompt_token_ids: list[int] | None, prompt_embeds: Tensor | None,
            streamed: bool, arrival_time: float, prompt: str | None = None,
            diffusion: DiffusionParams | None = None, **_: object) -> None:
        self.engine.add_request(request_id, arrival_time)
        if not streamed:
            ids = torch.tensor(prompt_token_ids or [], dtype=torch.int64)
            self.engine.feed(request_id, {"token_ids": ids}, close=True)

    def feed(self, request_id: str, feed: StageFeed) -> None:
        self.engine.feed(request_id, feed.tensors, close=False)

    def close_input(self, request_id: str) -> None:
        self.engine.feed(request_id, None, close=True)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests

    def step(self) -> list[StageResult]:
        results = []
        for r in self.engine.step():
            metrics = None
            if r.finished and r.request is not None and r.request.first_scheduled_time:
                metrics = {"queue_time": r.request.first_scheduled_time - r.request.arrival_time,
                           "num_chunks": r.request.num_chunks_out,
                           "model_seconds": r.request.model_seconds}
            results.append(StageResult(
                r.request_id, tensors=r.tensors, finished=r.finished,
                finish_reason=("error" if r.error else "stop") if r.finished else None,
                error=r.error, engine_metrics=metrics))
        return results


class DiffusionStage:
    """A stage of a diffusion pipeline; its component says which part it runs:

        flux               the whole pipeline: prompt in, images out. With an input edge (a
                           split graph) it loads no text encoder: each request is prepared and
                           parked until its conditioning arrives on the edge, then denoised
        flux.text_encoder  the pipeline's text encoders alone (TextEncodingEngine): prompt in,
                           conditioning out, batched over requests; an entry stage

    The second form keeps the kind (`diffusion`): its requests are a diffusion stage's, a text
    prompt with DiffusionParams, which the front door already routes to diffusion entry stages.
    """

    def __init__(self, stage: StageConfig, model: str | None, device: str) -> None:
        if not stage.component:
            raise ValueError(f"stage {stage.name!r}: a diffusion stage needs a component")
        name, _, part = stage.component.partition(".")
        if part not in ("", TEXT_ENCODER_PART):
            raise ValueError(f"stage {stage.name!r}: component {stage.component!r}: the part "
                             f"after {name!r} can only be {TEXT_ENCODER_PART!r}")
        dev = resolve_device(device)
        cls = get_pipeline_class(name)
        dtype = None if stage.dtype == "auto" else resolve_dtype(stage.dtype, None, dev)
        path = stage.model or model
        self.conditioned = bool(stage.inputs)          # conditioning comes along an edge
        if (part or self.conditioned) and not is_split_pipeline(cls):
            raise ValueError(f"stage {stage.name!r}: the {name!r} pipeline encodes its own "
                             "prompts; its text encoding cannot run in another stage")
        self.engine: DiffusionEngine | TextEncodingEngine
        if part:
            if self.conditioned:
                raise ValueError(f"stage {stage.name!r}: a text-encoder stage reads the "
                                 "request's prompt; it takes no input edge")
            self.engine = TextEncodingEngine(cls.load_prompt_encoder(path, dev, dtype),
                                             stage.max_num_seqs)
            return
        extra = {"text_encoders": False} if self.conditioned else {}
        unknown = set(stage.options) - {"compile"}
        if unknown:
            raise ValueError(f"stage {stage.name!r}: unknown diffusion options {sorted(unknown)} "
                             "(known: compile)")
        pipeline = cls.from_pretrained(path, name, dev, dtype, **extra)
        if stage.options.get("compile"):
            backend = stage.options["compile"]
            compile_blocks(getattr(pipeline, "transformer", None) or pipeline.model,
                           backend if isinstance(backend, str) else "inductor")
        self.engine = DiffusionEngine(pipeline, stage.max_num_seqs)

    def add(self, request_id: str, params: SamplingParams | None,
            prompt_token_ids: list[int] | None, prompt_embeds: Tensor | None,
            streamed: bool, arrival_time: float, prompt: str | None = None,
            diffusion: DiffusionParams | None = None, **_: object) -> None:
        diffusion = diffusion or DiffusionParams()
        if self.conditioned:          # the prompt was encoded upstream
            if not streamed:
                raise ValueError("this diffusion stage takes its conditioning from its input "
                                 "edge, but the request has no upstream stage")
            self.engine.add_request(request_id, None, diffusion, arrival_time)
            return
        if streamed or prompt is None:
            raise ValueError("a diffusion stage takes a text prompt from the request")
        self.engine.add_request(request_id, prompt, diffusion, arrival_time)

    def feed(self, request_id: str, feed: StageFeed) -> None:
        if not self.conditioned:
            raise ValueError("this diffusion stage takes no streamed input (no input edge)")
        if feed.tensors:
            self.engine.set_conditioning(request_id, feed.tensors)

    def close_input(self, request_id: str) -> None:
        if self.conditioned and self.engine.is_parked(request_id):
            raise ValueError("conditioning: the upstream stage finished without sending any")

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests

    def step(self) -> list[StageResult]:
        if isinstance(self.engine, TextEncodingEngine):
            return [StageResult(r.request_id, tensors=r.tensors, finished=True,
                                finish_reason="error" if r.error else "stop", error=r.error,
                                engine_metrics=r.metrics)
                    for r in self.engine.step()]
        return [StageResult(r.request_id,
                            tensors={"images": r.images} if r.images is not None else {},
                            finished=r.finished,
                            finish_reason=("error" if r.error else "stop") if r.finished else None,
                            error=r.error, engine_metrics=r.metrics, progress=r.progress)
                for r in self.engine.step()]


# AR stages whose model is one component of a larger checkpoint, with its own input handling:
# component -> (module, function(stage, model, device) -> stage engine)
AR_COMPONENTS: dict[str, tuple[str, str]] = {
    "qwen3_omni_thinker": ("omnistage.stages.qwen3_omni", "build_stage"),
    "qwen3_omni_talker": ("omnistage.stages.qwen3_omni", "build_stage"),
}


def build_stage_engine(stage: StageConfig, model: str | None, device: str) -> StageEngine:
    if stage.kind == "ar":
        if not (stage.model or model):
            raise ValueError(f"stage {stage.name!r}: no model (set the graph's or the stage's)")
        if stage.component is not None:
            if stage.component not in AR_COMPONENTS:
                raise ValueError(f"stage {stage.name!r}: ar component {stage.component!r} is not "
                                 f"registered (known: {', '.join(sorted(AR_COMPONENTS))})")
            module, fn = AR_COMPONENTS[stage.component]
            return getattr(importlib.import_module(module), fn)(stage, model or "", device)
        return ARStage(stage, model or "", device)
    if stage.kind == "generation":
        return GenerationStage(stage, model, device)
    if stage.kind == "diffusion":
        return DiffusionStage(stage, model, device)
    raise ValueError(f"stage {stage.name!r}: kind {stage.kind!r} has no engine yet")
