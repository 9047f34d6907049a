"""An AR stage's `ar.quantization` (configs/quantization.py `ar_method`): the same record as a
diffusion stage's, read from YAML, overrides and Python, naming the stage's one model (a bare
method, or its role: thinker / talker); what an AR stage cannot apply is refused with its
path before anything loads."""

from __future__ import annotations

import pytest

from omnistage.configs.defaults import resolve_graph
from omnistage.configs.parse import apply_overrides
from omnistage.configs.quantization import ComponentQuantization, ar_role
from omnistage.configs.schema import ARSettings, StageConfig
from omnistage.configs.strict import ConfigError, from_dict, load_yaml

FP8, INT8 = ComponentQuantization("fp8"), ComponentQuantization("int8")


def stage(text: str, component: str | None = None) -> StageConfig:
    data = {"name": "s", "kind": "ar", "component": component, "ar": load_yaml(text)}
    return from_dict(StageConfig, data, "stages[0]")


@pytest.mark.parametrize("text, component, want", [
    ("quantization: int8", None, INT8),
    ("quantization: {transformer: fp8}", "glm_image_ar", FP8),
    ("quantization: {thinker: fp8}", "qwen3_omni_thinker", FP8),
    ("quantization: thinker=int8", "qwen2_5_omni_thinker", INT8),
    ("quantization: fp8", "qwen3_omni_talker", FP8),           # a bare method: the stage's model
    ("quantization: {talker: {method: int8}}", "qwen3_tts_talker", INT8),
    ("quantization: none", None, None),
    ("max_num_seqs: 2", None, None),
])
def test_forms_name_the_stage_model(text: str, component: str | None,
                                    want: ComponentQuantization | None) -> None:
    assert stage(text, component).ar_config("m", "cpu").quantization == want


@pytest.mark.parametrize("text, component, message", [
    ("quantization: {talker: fp8}", "qwen3_omni_thinker",
     r"stages\[0\].ar.quantization.talker: this AR stage loads the thinker \(qwen3_omni_thinker"
     r"\); quantize its talker on the stage that loads it"),
    ("quantization: {vae: none, text_encoder: int8}", None,
     "ar.quantization.text_encoder: this AR stage loads the transformer"),
    ('quantization: "gguf:/m.gguf"', None,
     r"ar.quantization.transformer: gguf:/m.gguf is not applied to an AR model \(supported: "
     r"fp8, int8, int4\)"),
    ("quantization: {transformer: fp8, thinker: int8}", "qwen3_omni_thinker",
     "transformer and thinker both name this stage's model"),
    ("quantization: {thinker: int2}", "qwen3_omni_thinker",
     r"stages\[0\].ar.quantization.thinker: 'int2' is not one of"),
])
def test_refused_with_the_path(text: str, component: str | None, message: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=message):
        stage(text, component)


def test_python_and_overrides() -> None:
    assert ARSettings(quantization={"transformer": "int8"}).quantization.transformer == INT8
    assert str(ARSettings(quantization="thinker=fp8").quantization) == "thinker=fp8"
    graph = apply_overrides(resolve_graph(None, None, "qwen3_omni"),
                            ["thinker.ar.quantization=thinker=fp8",
                             "talker.ar.quantization=int8"])
    assert graph.stage("thinker").ar_config("m", "cpu").quantization == FP8
    assert graph.stage("talker").ar_config("m", "cpu").quantization == INT8
    assert [ar_role(c) for c in (None, "qwen3_omni_thinker", "qwen3_tts_talker", "bagel_und")] \
        == ["transformer", "thinker", "talker", "transformer"]


def test_the_benchmarks_flag_gives_what_ar_config_takes() -> None:
    """`ar_offline --quantization fp8` (the GPU session's quant stage) hands ARConfig the
    record a stage's `ar.quantization: fp8` becomes, not the string (its first GPU run
    failed on that)."""
    from omnistage.benchmarks.ar_offline import stage_quantization

    assert stage_quantization("fp8") == FP8 and stage_quantization("int8") == INT8
