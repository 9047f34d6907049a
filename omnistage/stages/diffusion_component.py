"""What a diffusion stage's `component` names, checked before anything loads: the pipeline
class (its declared abilities, diffusion/pipeline.py) and the part it runs, the stage's
options, quantization and parallel layout against what the pipeline declares. The three
diffusion stages (stages/diffusion.py, text_encoder.py, diffusers.py) and the front door's
layout check (stages/ranks.py) share them; stages/factory.py picks the stage by them.

    component "flux"               the whole pipeline             DiffusionStage
    component "flux.text_encoder"  its text encoders alone        TextEncoderStage
    a pipeline with backend "diffusers" (the generic adapter)     DiffusersStage
"""

from __future__ import annotations

from dataclasses import dataclass

from omnistage import registry
from omnistage.configs.options import read_options
from omnistage.configs.schema import StageConfig
from omnistage.configs.strict import ConfigError
from omnistage.diffusion.image_input import image_files
from omnistage.diffusion.parallel import check_layout
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipeline import NATIVE, DiffusionPipeline
from omnistage.diffusion.text_encoding import TEXT_ENCODER_PART
from omnistage.stages.interface import StageRequest

# keys of a diffusion stage's `options` that are typed fields of `diffusion:` (ConfigError)
TYPED = ("compile", "cuda_graphs", "quantization", "max_num_seqs")


@dataclass(frozen=True, slots=True)
class PipelineComponent:
    """A diffusion stage's component: `name` in the registry, its pipeline class, and the
    part the stage runs ("" the whole pipeline, TEXT_ENCODER_PART its text encoders)."""
    name: str
    cls: type[DiffusionPipeline]
    part: str

    @property
    def is_text_encoder(self) -> bool:
        return self.part == TEXT_ENCODER_PART

    @property
    def is_native(self) -> bool:
        return self.cls.backend == NATIVE


def pipeline_component(stage: StageConfig) -> PipelineComponent:
    """The stage's component, resolved; ValueError naming the stage for one it cannot run."""
    if not stage.component:
        raise ValueError(f"stage {stage.name!r}: a diffusion stage needs a component")
    name, _, part = stage.component.partition(".")
    if part not in ("", TEXT_ENCODER_PART):
        raise ValueError(f"stage {stage.name!r}: component {stage.component!r}: the part "
                         f"after {name!r} can only be {TEXT_ENCODER_PART!r}")
    cls = registry.load_component("diffusion", name)
    if (part or stage.inputs) and not cls.splits_text:
        raise ValueError(f"stage {stage.name!r}: the {name!r} pipeline encodes its own "
                         "prompts; its text encoding cannot run in another stage")
    if part and stage.inputs:
        raise ValueError(f"stage {stage.name!r}: a text-encoder stage reads the request's "
                         "prompt; it takes no input edge")
    return PipelineComponent(name, cls, part)


def check_options(stage: StageConfig, cls: type[DiffusionPipeline]) -> object:
    """Before anything loads: the stage's `diffusion.options` as the pipeline's `Options`
    record (a key it lacks: did-you-mean; compile, cuda_graphs: moved to `diffusion.`), none
    for the generic diffusers adapter (diffusers runs its pipeline as it is)."""
    where = f"stage {stage.name!r}: diffusion.options"
    for key in TYPED:
        if key in stage.diffusion.options:
            raise ConfigError(f"{where}.{key}: moved to diffusion.{key}")
    if stage.diffusion.option_items and cls.backend != NATIVE:
        raise ValueError(f"stage {stage.name!r}: options "
                         f"{sorted(stage.diffusion.option_items)} do not apply to the generic "
                         "diffusers adapter (diffusers runs the pipeline)")
    return read_options(cls.Options, stage.diffusion.options, where)


def check_quantization(stage: StageConfig, cls: type[DiffusionPipeline], part: str) -> None:
    """Before anything loads: `quantization` is for a native pipeline's denoiser, not for a
    text-encoder stage or the generic diffusers adapter."""
    if stage.diffusion.quantization is None:
        return
    if part or cls.backend != NATIVE:
        what = "a text-encoder stage" if part else "the generic diffusers adapter"
        raise ValueError(f"stage {stage.name!r}: quantization {stage.diffusion.quantization} "
                         "applies to "
                         f"a native pipeline's transformer, not to {what}")


def check_parallel_layout(stage: StageConfig, path: str | None) -> None:
    """A diffusion stage's ranks split what its pipeline can split (diffusion/parallel.py:
    the axes it declares, heads that divide, CFG-parallel only with true CFG); a text-encoder
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


def request_params(request: StageRequest) -> DiffusionParams:
    """The request's params, with an edit's image files (the worker took them from the
    connector) in place of the ImageRefs they came with."""
    params = request.diffusion or DiffusionParams()
    files = image_files(request.multimodal)
    return params.attach_image(files) if files else params
