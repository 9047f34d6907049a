"""The model-family table: lookups by architecture, diffusers class and component name, the
default graph of every family, and families registered from outside the production table."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from omnistage import registry
from omnistage.configs.defaults import resolve_graph
from omnistage.configs.graph import load_graph, validate_graph
from omnistage.registry import Component, ModelFamily, SpeechSpec
from omnistage.stages import adapters


def folder(tmp_path: Path, name: str, content: dict) -> Path:
    """A checkpoint folder holding only its config.json or model_index.json."""
    (tmp_path / name).write_text(json.dumps(content))
    return tmp_path


def test_unknown_architecture_lists_the_known_ones(tmp_path: Path) -> None:
    path = folder(tmp_path, "config.json", {"architectures": ["LlamaForCausalLM"]})
    # (test families registered in this process, e.g. the toy TTS, sort after these)
    with pytest.raises(ValueError, match=r"architecture LlamaForCausalLM is not supported "
                       r"\(supported: BagelForConditionalGeneration, CosyVoice3, "
                       r"HunyuanImage3ForCausalMM, "
                       r"MiMoAudioForCausalLM, "
                       r"MoshiForConditionalGeneration, "
                       r"Qwen2ForCausalLM, Qwen2_5OmniForConditionalGeneration, "
                       r"Qwen3ForCausalLM, "
                       r"Qwen3OmniMoeForConditionalGeneration, "
                       r"Qwen3TTSForConditionalGeneration[,)]"):
        registry.family_of_folder(path)
    assert registry.match_folder(path) is None
    # an AR model class exists for the text LLMs only
    with pytest.raises(ValueError, match=r"'LlamaForCausalLM' is not supported \(supported: "
                                         r"Qwen2ForCausalLM, Qwen3ForCausalLM\)$"):
        registry.model_class("LlamaForCausalLM")


def test_a_diffusers_class_without_a_row_goes_to_the_generic_adapter(tmp_path: Path) -> None:
    path = folder(tmp_path, "model_index.json", {"_class_name": "StableDiffusionPipeline"})
    found = registry.family_of_folder(path)
    assert found.name == "diffusers" and found.any_diffusers
    (stage,) = resolve_graph(str(path), path, None).stages
    assert (stage.kind, stage.component, stage.final) == ("diffusion", "diffusers", "image")
    assert registry.load_component("diffusion", "diffusers").__name__ == "DiffusersPipeline"
    # a native row still wins over the generic adapter
    assert registry.family_of_folder(
        folder(tmp_path, "model_index.json", {"_class_name": "FluxPipeline"})).name == "flux"


def test_a_diffusers_folder_naming_no_class_lists_the_native_ones(tmp_path: Path) -> None:
    path = folder(tmp_path, "model_index.json", {"_diffusers_version": "0.42.1"})
    with pytest.raises(ValueError, match=r"diffusers pipeline \(none\) is not supported "
                       r"\(natively: Flux2KleinPipeline, Flux2Pipeline, FluxPipeline, "
                       r"GlmImagePipeline, HunyuanVideo15ImageToVideoPipeline, "
                       r"HunyuanVideo15Pipeline, LTX2ImageToVideoPipeline, LTX2Pipeline, "
                       r"QwenImageEditPipeline, QwenImageEditPlusPipeline, "
                       r"QwenImagePipeline, StableDiffusion3Pipeline, WanImageToVideoPipeline, "
                       r"WanPipeline, ZImagePipeline\)"):
        resolve_graph(str(path), path, None)


@pytest.mark.parametrize("architecture, family, graph", [
    ("Qwen3ForCausalLM", "qwen3", "llm.yaml"), ("Qwen2ForCausalLM", "qwen2", "llm.yaml"),
    ("Qwen3OmniMoeForConditionalGeneration", "qwen3_omni", "qwen3_omni.yaml"),
    ("Qwen2_5OmniForConditionalGeneration", "qwen2_5_omni", "qwen2_5_omni.yaml")])
def test_lookup_by_architecture(tmp_path: Path, architecture: str, family: str,
                                graph: str) -> None:
    path = folder(tmp_path, "config.json", {"architectures": [architecture]})
    found = registry.family_of_folder(path)
    assert (found.name, found.graph) == (family, graph)
    assert registry.family(family) is found
    resolved = resolve_graph(str(path), path, None)
    assert resolved.model == str(path)
    assert resolved.stages == load_graph(_graph_text(graph), [f"model={path}"]).stages


def test_model_class_by_architecture() -> None:
    from omnistage.models.qwen2 import Qwen2ForCausalLM
    from omnistage.models.qwen3 import Qwen3ForCausalLM

    assert registry.model_class("Qwen3ForCausalLM") is Qwen3ForCausalLM
    assert registry.model_class("Qwen2ForCausalLM") is Qwen2ForCausalLM


@pytest.mark.parametrize("diffusers_class, family", [
    ("FluxPipeline", "flux"), ("ZImagePipeline", "z_image"), ("QwenImagePipeline", "qwen_image")])
def test_lookup_by_diffusers_class(tmp_path: Path, diffusers_class: str, family: str) -> None:
    path = folder(tmp_path, "model_index.json", {"_class_name": diffusers_class})
    found = registry.family_of_folder(path)
    assert found.name == family and found.diffusers_classes == (diffusers_class,)
    pipeline = registry.load_component("diffusion", family)
    assert pipeline.__name__ == diffusers_class     # ours carries the diffusers name
    (stage,) = resolve_graph(str(path), path, None).stages
    assert (stage.kind, stage.component, stage.model) == ("diffusion", family, None)


def test_no_model_named_runs_the_demo_family() -> None:
    (stage,) = resolve_graph(None, None, None).stages
    demo = registry.family(registry.DEMO)
    assert demo.graph == "digits.yaml" and stage.component == "digits_dit"
    assert registry.load_component("diffusion", "digits_dit").__name__ == "DigitsPipeline"


def test_every_default_graph_exists_validates_and_names_registered_parts() -> None:
    """Each family's YAML is shipped and valid, its adapters and its stages' components are
    registered, and every target of every row imports."""
    for family in registry.families().values():
        for target in [family.model, family.processor, *(c.target for c in family.components)]:
            if target is not None:
                assert registry.load(target) is not None, (family.name, target)
        if family.graph is None:
            continue
        graph = load_graph(_graph_text(family.graph))
        validate_graph(graph, adapters=adapters.registered())
        for stage in graph.stages:
            if stage.component is not None:
                registry.load_component(stage.kind, stage.component.partition(".")[0])


def test_unknown_component_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"diffusion component 'sdxl' is not registered "
                                         r"\(known: .*flux.*qwen_image.*z_image"):
        registry.load_component("diffusion", "sdxl")
    with pytest.raises(ValueError, match="model family 'nope' is not registered"):
        registry.family("nope")


def test_a_family_cannot_take_another_ones_match() -> None:
    thief = ModelFamily("my_qwen", architectures=("Qwen3ForCausalLM",), components=(
        Component("diffusion", "flux", "somewhere:Else"),))
    with pytest.raises(ValueError, match=r"family 'my_qwen': architecture 'Qwen3ForCausalLM', "
                                         r"diffusion component 'flux' already registered"):
        registry.register_family(thief, "tests.test_registry")
    assert "my_qwen" not in registry.families()


def _graph_text(name: str) -> str:
    return resources.files("omnistage.configs").joinpath(name).read_text()


def test_speech_spec_of_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A family's speech spec, or the one its "module:function" target gives for the folder
    (variants of one architecture differ); none for a model without speech."""
    from omnistage.testing import toy_tts

    spec = registry.speech_spec(folder(tmp_path, "config.json",
                                       {"architectures": [toy_tts.ARCHITECTURE]}))
    assert spec is not None and spec.voices == toy_tts.VOICES and spec.cloning
    assert registry.speech_spec(None) is None
    assert registry.speech_spec(folder(tmp_path / "..", "config.json",
                                       {"architectures": ["Qwen3ForCausalLM"]})) is None
    # a row for this test only (the table is restored after it)
    monkeypatch.setitem(registry._FAMILIES, "speech_by_folder", ModelFamily(
        "speech_by_folder", architectures=("ByFolderTTS",), speech=f"{__name__}:design_only"))
    spec = registry.speech_spec(folder(tmp_path, "config.json",
                                       {"architectures": ["ByFolderTTS"]}))
    assert spec == SpeechSpec(voice_design=True, max_input_chars=7)
    with pytest.raises(ValueError, match="preset voices, cloning or voice design"):
        SpeechSpec()


def test_video_spec_of_a_folder_and_its_frame_rule(tmp_path: Path) -> None:
    """The toy video family's spec by its folder; none for a model without video. The frame
    rule (Wan's 1 + 4k): counts off the rule are invalid, seconds snap to the nearest valid
    count, never below one frame; a spec breaking its own rule is refused."""
    from omnistage.registry import VideoSpec
    from omnistage.testing import toy_video

    spec = registry.video_spec(folder(tmp_path, "config.json",
                                      {"architectures": [toy_video.ARCHITECTURE]}))
    assert spec == toy_video.SPEC and spec.image_to_video
    assert registry.video_spec(None) is None
    wan = VideoSpec()                                       # 1 + 4k, 16 fps, 81 frames
    assert [n for n in range(1, 14) if wan.valid_num_frames(n)] == [1, 5, 9, 13]
    assert wan.num_frames_for(5, 16) == 81 and wan.num_frames_for(0.01, 16) == 1
    assert wan.num_frames_for(1, 16) == 17
    assert VideoSpec(frame_offset=0, frame_multiple=8, default_num_frames=8,
                     max_num_frames=64).num_frames_for(0.1, 8) == 8
    with pytest.raises(ValueError, match="rule"):
        VideoSpec(default_num_frames=80)
    with pytest.raises(ValueError, match="even"):
        VideoSpec(size_multiple=15)


def design_only(model_path: Path) -> SpeechSpec:
    return SpeechSpec(voice_design=True, max_input_chars=7)
