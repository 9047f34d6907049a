"""A diffusion stage of our engine: a native pipeline (diffusion/pipelines/*) stepped by
DiffusionEngine behind the stage interface. Its siblings: stages/text_encoder.py (a
pipeline's text encoders alone) and stages/diffusers.py (the generic diffusers adapter);
stages/factory.py picks among them by the component (stages/diffusion_component.py)."""

from __future__ import annotations

import torch

from omnistage.configs.schema import StageConfig
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.memory import CudaProbe, MemoryBudget
from omnistage.diffusion.pipeline import DiffusionPipeline, compile_blocks
from omnistage.layers.groups import stage_ranks
from omnistage.payloads import final_pixels
from omnistage.stages.adapters import StageFeed
from omnistage.stages.diffusion_component import (check_options, check_parallel_layout,
                                                  check_quantization, pipeline_component,
                                                  request_params)
from omnistage.stages.interface import EngineStats, StageInfo, StageRequest, StageResult
from omnistage.stages.quantize import (attention_while_loading, check_components,
                                       quantize_pipeline)
from omnistage.utils.compile_cache import persistent_compile_cache
from omnistage.utils.device import resolve_device, resolve_dtype

__all__ = ["DiffusionStage", "apply_options", "check_parallel_layout", "check_quantization",
           "quantize_pipeline"]

MAX_GRAPHS = 8          # a stage's `cuda_graphs: true`: at most this many shapes


class DiffusionStage:
    """The whole pipeline: prompt in, images (or a video's frames) out. With an input edge (a
    split graph) it loads no text encoder: each request is prepared and parked until its
    conditioning arrives on the edge, then denoised. A pipeline that declares
    `text_with_upstream` (glm_image) keeps its text encoder and the request's prompt, and
    parks for the edge's tokens.

    Over several ranks (the stage's parallel sizes; diffusion/parallel.py says which pipeline
    takes which): rank 0 loads the whole pipeline and serves; the others load no text encoder
    and `follow()` rank 0's steps until `stop_followers()`.
    """

    def __init__(self, stage: StageConfig, model: str | None, device: str) -> None:
        component = pipeline_component(stage)
        cls, path = component.cls, stage.model or model
        check_parallel_layout(stage, path)
        if component.is_text_encoder or not component.is_native:
            raise ValueError(f"stage {stage.name!r}: component {stage.component!r} runs in a "
                             "text-encoder or diffusers stage (stages/factory.py)")
        dev = resolve_device(device)
        dtype = None if stage.dtype == "auto" else resolve_dtype(stage.dtype, None, dev)
        check_quantization(stage, cls, "")
        check_components(stage)
        options = check_options(stage, cls)
        self.conditioned = bool(stage.inputs)          # conditioning comes along an edge
        # the prompt is still encoded here, beside what the edge brings (GLM-Image's glyphs)
        self.text_here = cls.text_with_upstream
        # what `decode` returns, by the graph's word: uint8 (n, H, W, C) images, or for a
        # video pipeline (`final: video`) uint8 (n, F, H, W, 3) frames
        self.is_video = stage.final == "video"     # its output: Video frames, else Images
        # followers (ranks > 0) get rank 0's prepared requests: no text encoder of their own
        leader = stage_ranks().is_leader
        extra = ({"text_encoders": False}
                 if (self.conditioned and not self.text_here) or not leader else {})
        if stage.diffusion.offload_blocks:
            check_offload(stage, cls)
            extra["offload"] = stage.diffusion.offload_blocks
        with attention_while_loading(stage, dev):     # quantization.attention
            pipeline = cls.from_pretrained(path, component.name, dev, dtype, **extra)
            quantize_pipeline(stage, pipeline, dev)
        # the front door refuses an edit with more images than the pipeline takes
        self.stage_info = StageInfo(max_input_images=pipeline.max_input_images)
        apply_options(stage, pipeline, dev, options)
        # on CUDA, memory_fraction bounds weights plus each step's activations
        memory = (MemoryBudget.of_fraction(CudaProbe(dev), stage.placement.memory_fraction,
                                           cfg_split=stage.parallel.cfg > 1)
                  if dev.type == "cuda" else None)
        self.engine = DiffusionEngine(pipeline, stage.diffusion.max_num_seqs, memory=memory)
        self.engine.profile_memory()

    def follow(self) -> None:
        """Ranks > 0: run rank 0's steps until it stops them."""
        self.engine.follow()

    def stop_followers(self) -> None:
        """Rank 0, at shutdown: end the other ranks' `follow`."""
        self.engine.stop_followers()

    def add(self, request: StageRequest) -> None:
        diffusion = request_params(request)
        rid, arrival = request.request_id, request.arrival_time
        if self.conditioned:          # the prompt was encoded upstream
            if not request.streamed:
                raise ValueError("this diffusion stage takes its conditioning from its input "
                                 "edge, but the request has no upstream stage")
            if self.text_here and request.prompt is None:
                raise ValueError("prompt: this diffusion stage encodes the request's prompt "
                                 "beside its input edge's conditioning, but none came")
            self.engine.add_request(rid, request.prompt if self.text_here else None, diffusion,
                                    arrival, parked=True)
            return
        if request.streamed or request.prompt is None:
            raise ValueError("a diffusion stage takes a text prompt from the request")
        self.engine.add_request(rid, request.prompt, diffusion, arrival)

    def feed(self, request_id: str, feed: StageFeed) -> None:
        if not self.conditioned:
            raise ValueError("this diffusion stage takes no streamed input (no input edge)")
        if feed.payload:
            self.engine.set_conditioning(request_id, feed.payload.pack())

    def close_input(self, request_id: str) -> None:
        if self.conditioned and self.engine.is_parked(request_id):
            raise ValueError("conditioning: the upstream stage finished without sending any")

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests

    def info(self) -> StageInfo:
        """How many input images an edit may bring (max_input_images)."""
        return self.stage_info

    def stats(self) -> EngineStats:
        """Running: the requests being denoised; waiting: those parked for their conditioning."""
        num_running = len(self.engine.requests)
        return EngineStats(num_running, self.engine.num_unfinished_requests - num_running)

    def step(self) -> list[StageResult]:
        return [StageResult(r.request_id,
                            payload=final_pixels(r.images, self.is_video),
                            finished=r.finished,
                            finish_reason=("error" if r.error else "stop") if r.finished else None,
                            error=r.error,
                            engine_metrics=r.metrics, progress=r.progress)
                for r in self.engine.step()]


def apply_options(stage: StageConfig, pipeline: DiffusionPipeline, dev: torch.device,
                  options: object = None) -> None:
    """A native pipeline's options: its own (`options`, its `Options` record from
    check_options), its transformer blocks compiled (by default on a CUDA
    device, one rank, for a pipeline whose `compile_default` says it measured faster so:
    Z-Image; Qwen-Image's and FLUX's fused kernels replayed from graphs beat their compiled
    form), CUDA graphs (on by default on a CUDA device for a pipeline whose transformer
    captures). Compiled code is cached on disk (utils/compile_cache.py), so a
    restart compiles nothing new."""
    if options is not None:
        pipeline.configure(options)
    cuda = dev.type == "cuda" and not stage.diffusion.offload_blocks   # offloaded: eager
    backend = _or(stage.diffusion.compile, cuda and pipeline.compile_default
                  and stage.parallel.world_size == 1)
    if backend:
        persistent_compile_cache()
        for model in pipeline.denoisers():
            compile_blocks(model, backend if isinstance(backend, str) else "inductor")
    graphs = _or(stage.diffusion.cuda_graphs, cuda and pipeline.graphable)
    if graphs:
        if dev.type != "cuda":
            raise ValueError(f"stage {stage.name!r}: cuda_graphs needs a CUDA device "
                             f"(this stage runs on {dev})")
        pipeline.use_cuda_graphs(MAX_GRAPHS if graphs is True else int(graphs))


def check_offload(stage: StageConfig, cls: type[DiffusionPipeline]) -> None:
    """ValueError unless the stage can offload its transformer's blocks: a pipeline that
    loads that way, one rank, not quantized (the quantized linears would leave the host
    buffers), neither compiled nor graphed (the blocks' weights move between forwards)."""
    name, d = stage.name, stage.diffusion
    if not cls.supports_offload:
        raise ValueError(f"stage {name!r}: diffusion.offload: {cls.label} {cls.__name__} does "
                         "not offload its transformer (FLUX.1, Qwen-Image, Z-Image, SD3 do)")
    if stage.parallel.world_size > 1:
        raise ValueError(f"stage {name!r}: diffusion.offload runs on one GPU (no parallel "
                         "layout): split the transformer over GPUs instead")
    if d.quantization is not None:
        raise ValueError(f"stage {name!r}: diffusion.offload with quantization is not "
                         "supported: choose one")
    if d.compile or d.cuda_graphs:
        raise ValueError(f"stage {name!r}: diffusion.offload runs eagerly: drop compile / "
                         "cuda_graphs")


def _or(value: object, default: object) -> object:
    """A typed option as set (`diffusion.compile: false` included), else its default."""
    return default if value is None else value
