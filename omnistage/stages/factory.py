"""The stage engine a stage config names: its kind, and for AR stages whose model is one
component of a larger checkpoint, that component's own stage."""

from __future__ import annotations

import importlib

from omnistage.configs.schema import StageConfig
from omnistage.stages.ar import ARStage
from omnistage.stages.interface import StageEngine


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
        from omnistage.stages.generation import GenerationStage

        return GenerationStage(stage, model, device)
    if stage.kind == "diffusion":
        from omnistage.stages.diffusion import DiffusionStage

        return DiffusionStage(stage, model, device)
    raise ValueError(f"stage {stage.name!r}: kind {stage.kind!r} has no engine yet")
