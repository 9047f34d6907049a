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
from omnistage.stages.diffusion_component import (check_parallel_layout, check_quantization,
                                                  pipeline_component)
from omnistage.stages.interface import EngineStats, StageInfo, StageResult
from omnistage.stages.prompt_stage import PromptEntryStage
from omnistage.utils.device import resolve_device, resolve_dtype


class TextEncoderStage(PromptEntryStage):
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
