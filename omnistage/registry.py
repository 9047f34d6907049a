"""Model families: one row each, the only table that says what a model name means.

A family is matched by its checkpoint folder (config.json's `architectures`, or a diffusers
folder's model_index.json `_class_name`) and says what runs it:

    ModelFamily("qwen3_omni",
                architectures=("Qwen3OmniMoeForConditionalGeneration",),
                graph="qwen3_omni.yaml",                 # omnistage/configs/qwen3_omni.yaml
                components=(Component("ar", "qwen3_omni_thinker", "omnistage.stages..."),
                            ...),                        # what a stage's `component:` names
                processor="omnistage.models.qwen3_omni.processing:InputProcessor")

Every lookup reads this one table: the AR model class of an architecture (`model_class`), a
stage's component (`load_component`: an AR stage builder, a diffusion pipeline, a generation
model), the default graph of a model folder (`family_of_folder`), the input processor of the
entry stage, and the module that registers a family's edge adapters (adapter "<family>.<name>").

Targets are "module:attribute" strings, imported only when a stage or the front door asks for
them: this module sits at the bottom floor with configs/ (configs/defaults.py reads it), while
what it names lives above (models, stages, diffusion, generation).

A text-to-speech family also says what it offers as speech (`speech`, a SpeechSpec): the
speech routes check requests against it and refuse models without one. A video family says
what video it makes (`video`, a VideoSpec) for /v1/videos the same way.

Adding a model = its files (model, pipeline or stage code), one row in `_BUILT_IN` below, its
default graph YAML in omnistage/configs/. Toy and out-of-tree models call `register_family` from
their own package instead (omnistage/testing/toy_pipeline.py registers the "testing" family), so
no test entry sits in the production table. A stage process spawned afterwards knows such a
family too: `register_family` names the registering module in OMNISTAGE_FAMILY_MODULES, which
every process imports before its first lookup.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from omnistage.family_records import (  # noqa: F401 (re-exported: the registry's records)
    Component, ComponentKind, ModelFamily, SpeechSpec, VideoSpec)

FAMILY_MODULES_ENV = "OMNISTAGE_FAMILY_MODULES"
DEMO = "digits"       # the family `omnistage serve` and `Omni()` run when no model is named


# an extra of pyproject.toml -> the module that tells it is installed
EXTRA_MODULES = {"diffusers": "diffusers", "ray": "ray", "cosyvoice3": "onnxruntime"}


def missing_extras(model_path: Path | None, backend: str) -> list[str]:
    """The pip extras that serving `model_path` on `backend` needs and this environment lacks."""
    import importlib.util

    family = match_folder(model_path) if model_path is not None else None
    needed = [*(family.extras if family else ()), *(["ray"] if backend == "ray" else [])]
    return [e for e in needed if importlib.util.find_spec(EXTRA_MODULES[e]) is None]


def _text_llm(name: str, architecture: str) -> ModelFamily:
    return ModelFamily(name, architectures=(architecture,), graph="llm.yaml",
                       model=f"omnistage.models.{name}:{architecture}")


def _pipeline(name: str, diffusers_class: str) -> ModelFamily:
    target = f"omnistage.diffusion.pipelines.{name}:{diffusers_class}"
    return ModelFamily(name, diffusers_classes=(diffusers_class,), graph=f"{name}.yaml",
                       components=(Component("diffusion", name, target),))


_OMNI_STAGES = "omnistage.stages.qwen3_omni:build_stage"
_OMNI25_STAGES = "omnistage.stages.qwen2_5_omni:build_stage"
_BUILT_IN = (
    _text_llm("qwen3", "Qwen3ForCausalLM"),
    _text_llm("qwen2", "Qwen2ForCausalLM"),
    ModelFamily(
        "qwen3_omni", architectures=("Qwen3OmniMoeForConditionalGeneration",),
        graph="qwen3_omni.yaml",
        components=(Component("ar", "qwen3_omni_thinker", _OMNI_STAGES),
                    Component("ar", "qwen3_omni_talker", _OMNI_STAGES),
                    Component("generation", "qwen3_omni_code2wav",
                              "omnistage.generation.code2wav:Code2WavGenerator")),
        processor="omnistage.models.qwen3_omni.processing:InputProcessor"),
    ModelFamily(
        "qwen2_5_omni", architectures=("Qwen2_5OmniForConditionalGeneration",),
        graph="qwen2_5_omni.yaml",
        components=(Component("ar", "qwen2_5_omni_thinker", _OMNI25_STAGES),
                    Component("ar", "qwen2_5_omni_talker", _OMNI25_STAGES),
                    Component("generation", "qwen2_5_omni_token2wav",
                              "omnistage.generation.token2wav:Token2WavGenerator")),
        processor="omnistage.models.qwen2_5_omni.processing:Qwen2_5OmniInputProcessor"),
    ModelFamily(
        "qwen3_tts", architectures=("Qwen3TTSForConditionalGeneration",),
        graph="qwen3_tts.yaml", speech="omnistage.stages.qwen3_tts:speech_spec",
        components=(Component("ar", "qwen3_tts_talker", "omnistage.stages.qwen3_tts:build_stage"),
                    Component("generation", "qwen3_tts_code2wav",
                              "omnistage.generation.code2wav:Code2WavGenerator"))),
    ModelFamily(
        "cosyvoice3", architectures=("CosyVoice3",), graph="cosyvoice3.yaml",
        speech="omnistage.stages.cosyvoice3:speech_spec", extras=("cosyvoice3",),
        tokenizer="CosyVoice-BlankEN", adapters="omnistage.stages.cosyvoice3_edge",
        components=(Component("ar", "cosyvoice3_llm", "omnistage.stages.cosyvoice3:build_stage"),
                    Component("generation", "cosyvoice3_flow_hift",
                              "omnistage.generation.cosyvoice3:CosyVoice3Generator"))),
    ModelFamily(
        "mimo_audio", architectures=("MiMoAudioForCausalLM",), graph="mimo_audio.yaml",
        speech="omnistage.stages.mimo_audio:speech_spec",
        components=(Component("ar", "mimo_audio_llm", "omnistage.stages.mimo_audio:build_stage"),
                    Component("generation", "mimo_audio_decoder",
                              "omnistage.generation.mimo_audio:MiMoAudioGenerator")),
        processor="omnistage.models.mimo_audio.prompt:MiMoAudioInputProcessor"),
    ModelFamily(
        "voxtral_tts", architectures=("VoxtralTTS",), graph="voxtral_tts.yaml",
        speech="omnistage.stages.voxtral_tts:speech_spec",
        components=(Component("ar", "voxtral_tts", "omnistage.stages.voxtral_tts:build_stage"),
                    Component("generation", "voxtral_tts_decoder",
                              "omnistage.generation.voxtral_tts:VoxtralTTSGenerator"))),
    ModelFamily("vibevoice", architectures=("VibeVoiceForConditionalGeneration",),
                graph="vibevoice.yaml", speech="omnistage.stages.vibevoice:speech_spec",
                components=(Component("ar", "vibevoice",
                                      "omnistage.stages.vibevoice:build_stage"),)),
    ModelFamily("moshi", architectures=("MoshiForConditionalGeneration",),
                duplex="omnistage.stages.moshi_duplex:MoshiDuplex"),
    ModelFamily("wan", diffusers_classes=("WanPipeline",), graph="wan.yaml",
                components=(Component("diffusion", "wan",
                                      "omnistage.diffusion.pipelines.wan:WanPipeline"),),
                video="omnistage.diffusion.pipelines.wan:video_spec"),
    ModelFamily("wan_i2v", diffusers_classes=("WanImageToVideoPipeline",), graph="wan_i2v.yaml",
                components=(Component(
                    "diffusion", "wan_i2v",
                    "omnistage.diffusion.pipelines.wan_i2v:WanImageToVideoPipeline"),),
                video="omnistage.diffusion.pipelines.wan_i2v:video_spec"),
    ModelFamily("ltx2", diffusers_classes=("LTX2Pipeline",), graph="ltx2.yaml",
                components=(Component("diffusion", "ltx2",
                                      "omnistage.diffusion.pipelines.ltx2:LTX2Pipeline"),),
                video="omnistage.diffusion.pipelines.ltx2:video_spec"),
    ModelFamily("ltx2_i2v", diffusers_classes=("LTX2ImageToVideoPipeline",),
                graph="ltx2_i2v.yaml", components=(Component(
                    "diffusion", "ltx2_i2v",
                    "omnistage.diffusion.pipelines.ltx2_i2v:LTX2ImageToVideoPipeline"),),
                video="omnistage.diffusion.pipelines.ltx2_i2v:video_spec"),
    ModelFamily("hunyuan_video15", diffusers_classes=("HunyuanVideo15Pipeline",),
                graph="hunyuan_video15.yaml", components=(Component(
                    "diffusion", "hunyuan_video15",
                    "omnistage.diffusion.pipelines.hunyuan_video15:HunyuanVideo15Pipeline"),),
                video="omnistage.diffusion.pipelines.hunyuan_video15:video_spec"),
    ModelFamily("hunyuan_video15_i2v", diffusers_classes=("HunyuanVideo15ImageToVideoPipeline",),
                graph="hunyuan_video15_i2v.yaml", components=(Component(
                    "diffusion", "hunyuan_video15_i2v",
                    "omnistage.diffusion.pipelines.hunyuan_video15_i2v:"
                    "HunyuanVideo15ImageToVideoPipeline"),),
                video="omnistage.diffusion.pipelines.hunyuan_video15_i2v:video_spec"),
    ModelFamily("glm_image", diffusers_classes=("GlmImagePipeline",), graph="glm_image.yaml",
                components=(Component("ar", "glm_image_ar",
                                      "omnistage.stages.glm_image:GlmImageARStage"),
                            Component("diffusion", "glm_image",
                                      "omnistage.diffusion.pipelines.glm_image:GlmImagePipeline"))),
    ModelFamily("bagel", architectures=("BagelForConditionalGeneration",), graph="bagel.yaml",
                components=(Component("ar", "bagel_und", "omnistage.stages.bagel:BagelARStage"),
                            Component("diffusion", "bagel",
                                      "omnistage.diffusion.pipelines.bagel:BagelPipeline"),
                            Component("ar", "bagel_und_think",
                                      "omnistage.stages.bagel:BagelThinkARStage"),
                            Component("diffusion", "bagel_think",
                                      "omnistage.diffusion.pipelines.bagel:BagelThinkPipeline")),
                processor="omnistage.models.bagel.processing:BagelInputProcessor"),
    _pipeline("flux", "FluxPipeline"),
    ModelFamily("flux2", diffusers_classes=("Flux2Pipeline",), graph="flux2.yaml",
                components=(Component("diffusion", "flux2",
                                      "omnistage.diffusion.pipelines.flux2:Flux2Pipeline"),)),
    ModelFamily("flux2_klein", diffusers_classes=("Flux2KleinPipeline",),
                graph="flux2_klein.yaml", components=(Component(
                    "diffusion", "flux2_klein",
                    "omnistage.diffusion.pipelines.flux2:Flux2KleinPipeline"),)),
    _pipeline("z_image", "ZImagePipeline"),
    _pipeline("qwen_image", "QwenImagePipeline"),
    _pipeline("sd3", "StableDiffusion3Pipeline"),
    _pipeline("qwen_image_edit", "QwenImageEditPipeline"),
    ModelFamily("qwen_image_edit_plus", diffusers_classes=("QwenImageEditPlusPipeline",),
                graph="qwen_image_edit_plus.yaml", components=(Component(
                    "diffusion", "qwen_image_edit_plus",
                    "omnistage.diffusion.pipelines.qwen_image_edit:QwenImageEditPlusPipeline"),)),
    ModelFamily("digits", graph="digits.yaml", components=(Component(
        "diffusion", "digits_dit", "omnistage.diffusion.pipelines.digits:DigitsPipeline"),)),
    ModelFamily("hunyuan_image3", architectures=("HunyuanImage3ForCausalMM",),
                graph="hunyuan_image3.yaml", components=(Component(
                    "diffusion", "hunyuan_image3",
                    "omnistage.diffusion.pipelines.hunyuan_image3:HunyuanImage3Pipeline"),)),
    # the generic adapter: any other diffusers pipeline, run whole by diffusers (not native)
    ModelFamily("diffusers", any_diffusers=True, graph="diffusers.yaml", extras=("diffusers",),
                components=(Component(
        "diffusion", "diffusers", "omnistage.diffusion.diffusers_pipeline:DiffusersPipeline"),)),
)
_FAMILIES: dict[str, ModelFamily] = {}


def _add(family: ModelFamily) -> None:
    """Into the table, unless a name, a match or a component is taken by another family."""
    if _FAMILIES.get(family.name) == family:
        return                                  # the same row again (a module imported twice)
    taken = [f"family {family.name!r}"] if family.name in _FAMILIES else []
    for other in _FAMILIES.values():
        taken += [f"architecture {a!r}" for a in family.architectures if a in other.architectures]
        taken += [f"diffusers class {c!r}" for c in family.diffusers_classes
                  if c in other.diffusers_classes]
        theirs = {(c.kind, c.name) for c in other.components}
        taken += [f"{c.kind} component {c.name!r}" for c in family.components
                  if (c.kind, c.name) in theirs]
    if taken:
        raise ValueError(f"family {family.name!r}: {', '.join(taken)} already registered")
    _FAMILIES[family.name] = family


for _family in _BUILT_IN:
    _add(_family)


def register_family(family: ModelFamily, module: str) -> None:
    """Add a family that is not built in (toy and out-of-tree models). `module`: the module
    making this call (its `__name__`); stage processes spawned from now on import it before
    their first lookup, so they know the family too. A script's `__main__` needs no naming:
    spawned processes run its top level again."""
    _add(family)
    if module != "__main__":
        listed = [m for m in os.environ.get(FAMILY_MODULES_ENV, "").split(",") if m]
        if module not in listed:
            os.environ[FAMILY_MODULES_ENV] = ",".join([*listed, module])


def families() -> Mapping[str, ModelFamily]:
    """Every family by name, read-only: the built-in rows, then those registered in this
    process or in the process that started it (OMNISTAGE_FAMILY_MODULES)."""
    for module in os.environ.get(FAMILY_MODULES_ENV, "").split(","):
        if module and module not in sys.modules:
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise ImportError(f"{FAMILY_MODULES_ENV} names {module!r}, which registers a "
                                  f"model family, but it cannot be imported: {e}") from e
    return MappingProxyType(_FAMILIES)


def load(target: str) -> Any:
    """The object a "module:attribute" target names, its module imported now."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def family(name: str) -> ModelFamily:
    table = families()
    if name not in table:
        raise ValueError(f"model family {name!r} is not registered (known: "
                         f"{', '.join(sorted(table))})")
    return table[name]


def model_class(architecture: str) -> Any:
    """The AR model class built for a config.json architecture."""
    models = {a: f.model for f in families().values() if f.model for a in f.architectures}
    if architecture not in models:
        raise ValueError(f"architecture {architecture!r} is not supported "
                         f"(supported: {', '.join(sorted(models))})")
    return load(models[architecture])


def load_component(kind: ComponentKind, name: str) -> Any:
    """What a stage of `kind` whose `component:` is `name` runs (see `Component`)."""
    targets = {c.name: c.target for f in families().values() for c in f.components
               if c.kind == kind}
    if name not in targets:
        raise ValueError(f"{kind} component {name!r} is not registered "
                         f"(known: {', '.join(sorted(targets)) or 'none'})")
    return load(targets[name])


def match_folder(model_path: Path) -> ModelFamily | None:
    """The family serving a checkpoint folder, or None (not a checkpoint, or unknown): the row
    naming its architecture or diffusers class; else, for a diffusers pipeline, the generic
    adapter's (`any_diffusers`), which checks the class when its stage loads."""
    diffusers, archs = _folder_names(model_path)
    table = families().values()
    for f in table:
        if (diffusers is not None and diffusers in f.diffusers_classes) or \
                any(a in f.architectures for a in archs):
            return f
    if diffusers:
        return next((f for f in table if f.any_diffusers), None)
    return None


def family_of_folder(model_path: Path) -> ModelFamily:
    """The family serving a checkpoint folder; ValueError listing the supported ones."""
    found = match_folder(model_path)
    if found is not None:
        return found
    diffusers, archs = _folder_names(model_path)
    table = families().values()
    if diffusers is not None:
        supported = sorted(c for f in table for c in f.diffusers_classes)
        raise ValueError(f"{model_path}: diffusers pipeline {diffusers or '(none)'} is not "
                         f"supported (natively: {', '.join(supported)})")
    supported = sorted(a for f in table for a in f.architectures)
    raise ValueError(f"{model_path}: architecture {', '.join(archs) or '(none)'} is not supported "
                     f"(supported: {', '.join(supported)})")


def speech_spec(model_path: Path | None) -> SpeechSpec | None:
    """What the family serving `model_path` offers as text to speech (None: no speech)."""
    return _spec(model_path, "speech", SpeechSpec)


def video_spec(model_path: Path | None) -> VideoSpec | None:
    """What the family serving `model_path` makes as video (None: no video)."""
    return _spec(model_path, "video", VideoSpec)


def _spec(model_path: Path | None, field: str, kind: type) -> Any:
    """A family's `speech` / `video`: the spec as given, or what its target returns for the
    folder."""
    found = match_folder(model_path) if model_path is not None else None
    given = getattr(found, field) if found is not None else None
    if given is None or isinstance(given, kind):
        return given
    spec = load(given)(model_path)
    assert isinstance(spec, kind), f"{given} returned {type(spec).__name__}"
    return spec


def adapter_module(adapter: str) -> str | None:
    """The module registering adapter "<family>.<name>", or None (a generic adapter, or no
    such family)."""
    prefix, dot, _ = adapter.partition(".")
    found = families().get(prefix) if dot else None
    return found.adapters if found is not None else None


def adapter_modules() -> list[str]:
    return [f.adapters for f in families().values() if f.adapters]


def _folder_names(model_path: Path) -> tuple[str | None, list[str]]:
    """(model_index.json's `_class_name`, "" if it has none; None if no such file) and
    config.json's architectures ([] if no such file)."""
    index = Path(model_path) / "model_index.json"
    if index.is_file():
        return json.loads(index.read_text()).get("_class_name") or "", []
    if (Path(model_path) / "cosyvoice3.yaml").is_file():   # CosyVoice3's folder as released
        return None, ["CosyVoice3"]
    params = Path(model_path) / "params.json"              # Mistral's format
    if params.is_file() and json.loads(params.read_text()).get("model_type") == "voxtral_tts":
        return None, ["VoxtralTTS"]
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None, []
    return None, list(json.loads(config.read_text()).get("architectures") or [])
