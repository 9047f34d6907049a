"""A split graph's text-encoder stage: a diffusion pipeline's text encoders alone (component
"<pipeline>.text_encoder", e.g. "flux.text_encoder"), served by TextEncodingEngine: prompt in,
conditioning out, batched over requests; an entry stage.

It keeps the kind `diffusion`: its requests are a diffusion stage's, a text prompt with
DiffusionParams, which the front door already routes to diffusion entry stages.
"""

from __future__ import annotations

from omnistage.configs.schema import StageConfig
from omnistage.diffusion.text_encoding import TextEncodingEngine
from omnistage.payloads import ModelTensors, Payload
from omnistage.stages.adapters import StageFeed
from omnistage.stages.diffusion_component import (check_parallel_layout, check_quantization,
                                                  pipeline_component, request_params)
from omnistage.stages.interface import EngineStats, StageInfo, StageRequest, StageResult
from omnistage.utils.device import resolve_device, resolve_dtype


class TextEncoderStage:
    def __init__(self, stage: StageConfig, model: str | None, device: str) -> None:
        component = pipeline_component(stage)
        if not component.is_text_encoder:
            raise ValueError(f"stage {stage.name!r}: component {stage.component!r} is not a "
                             "pipeline's text encoder")
        path = stage.model or model
        check_parallel_layout(stage, path)
        check_quantization(stage, component.cls, component.part)
        dev = resolve_device(device)
        dtype = None if stage.dtype == "auto" else resolve_dtype(stage.dtype, None, dev)
        self.engine = TextEncodingEngine(component.cls.load_prompt_encoder(path, dev, dtype),
                                         stage.diffusion.max_num_seqs)

    def add(self, request: StageRequest) -> None:
        if request.streamed or request.prompt is None:
            raise ValueError("a diffusion stage takes a text prompt from the request")
        self.engine.add_request(request.request_id, request.prompt, request_params(request),
                                request.arrival_time)

    def feed(self, request_id: str, feed: StageFeed) -> None:
        raise ValueError("this diffusion stage takes no streamed input (no input edge)")

    def close_input(self, request_id: str) -> None:
        pass

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests

    def info(self) -> StageInfo:
        return StageInfo()

    def stats(self) -> EngineStats:
        """Every request is running: it is done in the step that takes it."""
        return EngineStats(self.engine.num_unfinished_requests)

    def step(self) -> list[StageResult]:
        return [StageResult(r.request_id, payload=Payload(named=ModelTensors.unpack(r.tensors)),
                            finished=True, finish_reason="error" if r.error else "stop",
                            error=r.error,
                            engine_metrics=r.metrics)
                for r in self.engine.step()]
