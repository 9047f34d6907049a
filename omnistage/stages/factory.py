"""The stage engine a stage config names: its kind, and for AR stages whose model is one
component of a larger checkpoint, that component's own stage; for a diffusion stage, one stage
file per engine: our diffusion engine's (stages/diffusion.py), a pipeline's text encoders
alone (stages/text_encoder.py) or the generic diffusers adapter's (stages/diffusers.py)."""

from __future__ import annotations

from omnistage import registry
from omnistage.configs.schema import StageConfig
from omnistage.stages.ar import ARStage
from omnistage.stages.interface import StageEngine


def build_stage_engine(stage: StageConfig, model: str | None, device: str) -> StageEngine:
    if stage.kind == "ar":
        if not (stage.model or model):
            raise ValueError(f"stage {stage.name!r}: no model (set the graph's or the stage's)")
        if stage.component is not None:   # one part of a larger checkpoint: its own stage
            try:
                build = registry.load_component("ar", stage.component)
            except ValueError as e:
                raise ValueError(f"stage {stage.name!r}: {e}") from None
            return build(stage, model or "", device)
        return ARStage(stage, model or "", device)
    if stage.kind == "generation":
        from omnistage.stages.generation import GenerationStage

        return GenerationStage(stage, model, device)
    if stage.kind == "diffusion":
        return _diffusion_stage(stage, model, device)
    raise ValueError(f"stage {stage.name!r}: kind {stage.kind!r} has no engine yet")


def _diffusion_stage(stage: StageConfig, model: str | None, device: str) -> StageEngine:
    """The stage of the engine that runs the component (what its pipeline declares)."""
    from omnistage.stages.diffusion_component import pipeline_component

    component = pipeline_component(stage)
    if component.is_text_encoder:
        from omnistage.stages.text_encoder import TextEncoderStage

        return TextEncoderStage(stage, model, device)
    if not component.is_native:
        from omnistage.stages.diffusers import DiffusersStage

        return DiffusersStage(stage, model, device)
    from omnistage.stages.diffusion import DiffusionStage

    return DiffusionStage(stage, model, device)
