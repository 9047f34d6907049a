"""The generic diffusers adapter's stage: a diffusers pipeline with no native port
(diffusion/diffusers_pipeline.py, whose `backend` is "diffusers"), run whole by diffusers and
batched per call (diffusion/diffusers_engine.py). Not native, as its `info()` says: /v1/models
shows the backend and the pipeline class. No options, quantization, split text encoders or
several ranks: those need a native pipeline's phases."""

from __future__ import annotations

from omnistage.configs.schema import StageConfig
from omnistage.diffusion.diffusers_engine import DiffusersEngine
from omnistage.diffusion.diffusers_pipeline import BACKEND, DiffusersPipeline
from omnistage.payloads import final_pixels
from omnistage.stages.diffusion_component import (check_options, check_parallel_layout,
                                                  check_quantization, pipeline_component)
from omnistage.stages.interface import EngineStats, StageInfo, StageResult
from omnistage.stages.prompt_stage import PromptEntryStage
from omnistage.utils.device import resolve_device, resolve_dtype


class DiffusersStage(PromptEntryStage):
    def __init__(self, stage: StageConfig, model: str | None, device: str) -> None:
        component = pipeline_component(stage)
        if component.is_native or component.is_text_encoder:
            raise ValueError(f"stage {stage.name!r}: component {stage.component!r} is not the "
                             "generic diffusers adapter")
        path = stage.model or model
        check_parallel_layout(stage, path)
        check_quantization(stage, component.cls, "")
        check_options(stage, component.cls)
        dev = resolve_device(device)
        dtype = None if stage.dtype == "auto" else resolve_dtype(stage.dtype, None, dev)
        pipeline = DiffusersPipeline.from_pretrained(path, component.name, dev, dtype)
        self.stage_info = StageInfo(backend=BACKEND, pipeline=pipeline.class_name)
        self.engine = DiffusersEngine(pipeline, stage.diffusion.max_num_seqs)
        self.is_video = stage.final == "video"     # its output: Video frames, else Images

    def info(self) -> StageInfo:
        """backend "diffusers" and the pipeline class: /v1/models shows it as not native."""
        return self.stage_info

    def stats(self) -> EngineStats:
        """Running: the requests in the call; waiting: those for a later call."""
        num_running = self.engine.num_running
        return EngineStats(num_running, self.engine.num_unfinished_requests - num_running)

    def step(self) -> list[StageResult]:
        return [StageResult(r.request_id,
                            payload=final_pixels(r.images, self.is_video),
                            finished=r.finished,
                            finish_reason=("error" if r.error else "stop") if r.finished else None,
                            error=r.error,
                            engine_metrics=r.metrics, progress=r.progress)
                for r in self.engine.step()]
