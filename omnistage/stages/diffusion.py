"""A diffusion stage: a whole pipeline, or its text encoders alone, behind the stage
interface."""

from __future__ import annotations

import torch

from omnistage import registry
from omnistage.configs.schema import StageConfig
from omnistage.diffusion.diffusers_engine import DiffusersEngine
from omnistage.diffusion.diffusers_pipeline import BACKEND, DiffusersPipeline
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.image_input import image_files
from omnistage.diffusion.memory import CudaProbe, MemoryBudget
from omnistage.diffusion.parallel import check_layout
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipeline import DiffusionPipeline, compile_blocks, is_split_pipeline
from omnistage.diffusion.text_encoding import TEXT_ENCODER_PART, TextEncodingEngine
from omnistage.layers.fp8 import quantize_fp8
from omnistage.layers.groups import stage_ranks
from omnistage.stages.adapters import StageFeed
from omnistage.stages.interface import EngineStats, StageInfo, StageRequest, StageResult
from omnistage.utils.compile_cache import persistent_compile_cache
from omnistage.utils.device import resolve_device, resolve_dtype

# a diffusion stage's `options`: compile: true | false | a torch.compile backend (its blocks
# compiled; default: the pipeline's compile_default on CUDA, one rank); cuda_graphs: true | false | the most graphs (default: on for a CUDA device and a pipeline
# whose transformer captures, at most MAX_GRAPHS shapes); and those a pipeline class names in
# its `options`, handed to its `set_option(name, value)` (SD3's skip_layer_guidance)
OPTIONS = ("compile", "cuda_graphs")
MAX_GRAPHS = 8


class DiffusionStage:
    """A stage of a diffusion pipeline; its component says which part it runs:

        flux               the whole pipeline: prompt in, images out. With an input edge (a
                           split graph) it loads no text encoder: each request is prepared and
                           parked until its conditioning arrives on the edge, then denoised.
                           A pipeline with `text_with_upstream` (glm_image) keeps its text
                           encoder and the request's prompt, and parks for the edge's tokens
        flux.text_encoder  the pipeline's text encoders alone (TextEncodingEngine): prompt in,
                           conditioning out, batched over requests; an entry stage
        diffusers          the generic adapter (diffusion/diffusers_engine.py): a diffusers
                           pipeline with no native port, run whole by diffusers, batched per
                           call (DiffusersEngine in place of DiffusionEngine); not native, as
                           its `info()` says

    The second form keeps the kind (`diffusion`): its requests are a diffusion stage's, a text
    prompt with DiffusionParams, which the front door already routes to diffusion entry stages.

    Over several ranks (the stage's parallel sizes; diffusion/parallel.py says which pipeline
    takes which): rank 0 loads the whole pipeline and serves; the others load no text encoder
    and `follow()` rank 0's steps until `stop_followers()`.
    """

    def __init__(self, stage: StageConfig, model: str | None, device: str) -> None:
        if not stage.component:
            raise ValueError(f"stage {stage.name!r}: a diffusion stage needs a component")
        name, _, part = stage.component.partition(".")
        if part not in ("", TEXT_ENCODER_PART):
            raise ValueError(f"stage {stage.name!r}: component {stage.component!r}: the part "
                             f"after {name!r} can only be {TEXT_ENCODER_PART!r}")
        dev = resolve_device(device)
        cls = registry.load_component("diffusion", name)
        dtype = None if stage.dtype == "auto" else resolve_dtype(stage.dtype, None, dev)
        path = stage.model or model
        check_parallel_layout(stage, path)
        self.conditioned = bool(stage.inputs)          # conditioning comes along an edge
        # the prompt is still encoded here, beside what the edge brings (GLM-Image's glyphs)
        self.text_here = getattr(cls, "text_with_upstream", False)
        # what `decode` returns, by the graph's word: uint8 (n, H, W, C) images, or for a
        # video pipeline (`final: video`) uint8 (n, F, H, W, 3) frames
        self.output_key = "video" if stage.final == "video" else "images"
        if (part or self.conditioned) and not is_split_pipeline(cls):
            raise ValueError(f"stage {stage.name!r}: the {name!r} pipeline encodes its own "
                             "prompts; its text encoding cannot run in another stage")
        check_quantization(stage, cls, part)
        self.engine: DiffusionEngine | DiffusersEngine | TextEncodingEngine
        self.stage_info: StageInfo = {}
        if part:
            if self.conditioned:
                raise ValueError(f"stage {stage.name!r}: a text-encoder stage reads the "
                                 "request's prompt; it takes no input edge")
            self.engine = TextEncodingEngine(cls.load_prompt_encoder(path, dev, dtype),
                                             stage.max_num_seqs)
            return
        # followers (ranks > 0) get rank 0's prepared requests: no text encoder of their own
        leader = stage_ranks().is_leader
        extra = ({"text_encoders": False}
                 if (self.conditioned and not self.text_here) or not leader else {})
        check_options(stage, cls)
        pipeline = cls.from_pretrained(path, name, dev, dtype, **extra)
        if isinstance(pipeline, DiffusersPipeline):      # the generic adapter: whole calls
            self.stage_info = {"backend": BACKEND, "pipeline": pipeline.class_name}
            self.engine = DiffusersEngine(pipeline, stage.max_num_seqs)
            return
        # the front door refuses an edit with more images than the pipeline takes
        self.stage_info = {"max_input_images": getattr(pipeline, "max_input_images", 1)}
        quantize_pipeline(stage, pipeline, dev)
        apply_options(stage, pipeline, dev)
        # on CUDA, memory_fraction bounds weights plus each step's activations
        memory = (MemoryBudget.of_fraction(CudaProbe(dev), stage.memory_fraction,
                                           cfg_split=stage.cfg_parallel_size > 1)
                  if dev.type == "cuda" else None)
        self.engine = DiffusionEngine(pipeline, stage.max_num_seqs, memory=memory)
        self.engine.profile_memory()

    def follow(self) -> None:
        """Ranks > 0: run rank 0's steps until it stops them."""
        self.engine.follow()

    def stop_followers(self) -> None:
        """Rank 0, at shutdown: end the other ranks' `follow`."""
        if isinstance(self.engine, DiffusionEngine):
            self.engine.stop_followers()

    def add(self, request: StageRequest) -> None:
        diffusion = _params(request)
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

    def info(self) -> StageInfo:
        """The generic diffusers adapter says so (backend "diffusers", the pipeline class):
        /v1/models shows the model as not native. A native pipeline: how many input images an
        edit may bring (max_input_images)."""
        return self.stage_info

    def stats(self) -> EngineStats:
        """Running: the requests being denoised; waiting: those parked for their conditioning
        (a text-encoder stage has only running ones)."""
        num_running = (self.engine.num_running if isinstance(self.engine, DiffusersEngine)
                       else len(self.engine.requests))
        return EngineStats(num_running, self.engine.num_unfinished_requests - num_running)

    def step(self) -> list[StageResult]:
        if isinstance(self.engine, TextEncodingEngine):
            return [StageResult(r.request_id, tensors=r.tensors, finished=True,
                                finish_reason="error" if r.error else "stop", error=r.error,
                                engine_metrics=r.metrics)
                    for r in self.engine.step()]
        return [StageResult(r.request_id,
                            tensors={self.output_key: r.images} if r.images is not None else {},
                            finished=r.finished,
                            finish_reason=("error" if r.error else "stop") if r.finished else None,
                            error=r.error, engine_metrics=r.metrics, progress=r.progress)
                for r in self.engine.step()]


def check_options(stage: StageConfig, cls: type) -> None:
    """Before anything loads: every option known, none for the generic diffusers adapter
    (diffusers runs its pipeline as it is)."""
    known = (*OPTIONS, *getattr(cls, "options", ()))
    unknown = set(stage.options) - set(known)
    if unknown:
        raise ValueError(f"stage {stage.name!r}: unknown diffusion options {sorted(unknown)} "
                         f"(known: {', '.join(known)})")
    if stage.options and issubclass(cls, DiffusersPipeline):
        raise ValueError(f"stage {stage.name!r}: options {sorted(stage.options)} do not apply "
                         "to the generic diffusers adapter (diffusers runs the pipeline)")


def check_quantization(stage: StageConfig, cls: type, part: str) -> None:
    """Before anything loads: `quantization` is for a native pipeline's denoiser, not for a
    text-encoder stage or the generic diffusers adapter."""
    if stage.quantization is None:
        return
    if part or issubclass(cls, DiffusersPipeline):
        what = "a text-encoder stage" if part else "the generic diffusers adapter"
        raise ValueError(f"stage {stage.name!r}: quantization {stage.quantization} applies to "
                         f"a native pipeline's transformer, not to {what}")


def quantize_pipeline(stage: StageConfig, pipeline: DiffusionPipeline, dev: torch.device
                      ) -> None:
    """`quantization: fp8`: the pipeline's transformers (both of Wan 2.2's experts) get FP8
    linears (layers/fp8.py; ValueError on a device without FP8), their bf16 weights freed."""
    if stage.quantization is None:
        return
    denoiser = getattr(pipeline, "transformer", None) or pipeline.model
    for model in (denoiser, getattr(pipeline, "transformer_2", None)):
        if model is not None:
            quantize_fp8(model)
    if dev.type == "cuda":
        torch.cuda.empty_cache()          # the bf16 weights' blocks back to the device


def apply_options(stage: StageConfig, pipeline: DiffusionPipeline, dev: torch.device) -> None:
    """A native pipeline's `options`: its transformer blocks compiled (by default on a CUDA
    device, one rank, for a pipeline whose `compile_default` says it measured faster so:
    Z-Image; Qwen-Image's and FLUX's fused kernels replayed from graphs beat their compiled
    form), CUDA graphs (on by default on a CUDA device for a pipeline whose transformer
    captures), its own options. Compiled code is cached on disk (utils/compile_cache.py), so a
    restart compiles nothing new."""
    for name in getattr(pipeline, "options", ()):
        if name in stage.options:
            pipeline.set_option(name, stage.options[name])
    cuda = dev.type == "cuda"
    backend = stage.options.get("compile", cuda and getattr(pipeline, "compile_default", False)
                                and stage.parallel.world_size == 1)
    if backend:
        persistent_compile_cache()
        for model in (getattr(pipeline, "transformer", None) or pipeline.model,
                      getattr(pipeline, "transformer_2", None)):
            if model is not None:
                compile_blocks(model, backend if isinstance(backend, str) else "inductor")
    graphs = stage.options.get("cuda_graphs", cuda and getattr(pipeline, "graphable", False))
    if graphs:
        if dev.type != "cuda":
            raise ValueError(f"stage {stage.name!r}: cuda_graphs needs a CUDA device "
                             f"(this stage runs on {dev})")
        pipeline.use_cuda_graphs(MAX_GRAPHS if graphs is True else int(graphs))


def _params(request: StageRequest) -> DiffusionParams:
    """The request's params, with an edit's image files (the worker took them from the
    connector: inputs "image", "image.1", ...) in place of the ImageRefs they came with."""
    params = request.diffusion or DiffusionParams()
    files = image_files(request.multimodal)
    return params.attach_image(files) if files else params


def check_parallel_layout(stage: StageConfig, path: str | None) -> None:
    """A diffusion stage's ranks split what its pipeline can split (diffusion/parallel.py:
    the axes it takes, heads that divide, CFG-parallel only with true CFG); a text-encoder
    stage runs on one rank. Called before any stage starts, and by the stage itself."""
    if stage.parallel.world_size == 1 or not stage.component:
        return
    name, _, part = stage.component.partition(".")
    if part:
        raise ValueError(f"stage {stage.name!r}: a text-encoder stage runs on one rank")
    try:
        check_layout(registry.load_component("diffusion", name), name, stage.parallel, path)
    except ValueError as exc:
        raise ValueError(f"stage {stage.name!r}: {exc}") from None
