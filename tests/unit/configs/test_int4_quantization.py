"""`int4` (4-bit W4A16 at load, ar/quantize.py) is an AR model's method: accepted for an AR
stage's model (a text LLM's bare method, the thinker, the talker) from YAML, the flag's form
and Python, and refused for a diffusion stage's components (transformer, text_encoder, vae)
with the component and the methods it takes."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.configs.quantization import ComponentQuantization, Quantization
from omnistage.configs.schema import ARSettings, DiffusionSettings, StageConfig
from omnistage.configs.strict import ConfigError, from_dict, load_yaml

INT4 = ComponentQuantization("int4")


def stage(kind: str, text: str, component: str | None = None) -> StageConfig:
    data = {"name": "s", "kind": kind, "component": component, kind: load_yaml(text)}
    return from_dict(StageConfig, data, "stages[0]")


@pytest.mark.parametrize("text, component", [
    ("quantization: int4", None),                                   # a text LLM's bare method
    ("quantization: {transformer: {method: int4}}", "glm_image_ar"),
    ("quantization: {thinker: int4}", "qwen3_omni_thinker"),
    ("quantization: thinker=int4", "qwen2_5_omni_thinker"),
    ("quantization: int4", "qwen3_omni_talker"),                    # the bare method
    ("quantization: {talker: int4}", "qwen3_tts_talker"),
])
def test_ar_components_take_int4(text: str, component: str | None) -> None:
    assert stage("ar", text, component).ar_config("m", "cpu").quantization == INT4


def test_python_and_flag_forms() -> None:
    assert ARSettings(quantization="int4").quantization == Quantization(transformer=INT4)
    assert ARSettings(quantization={"thinker": "int4"}).quantization.thinker == INT4
    assert str(Quantization.parse("talker=int4")) == "talker=int4"
    assert ComponentQuantization.parse("int4") == INT4
    from omnistage.benchmarks.ar_offline import stage_quantization

    assert stage_quantization("int4") == INT4           # ar_offline --quantization int4


@pytest.mark.parametrize("value, message", [
    ("int4", r"quantization: transformer: int4 quantizes an AR model \(thinker, talker, a "
             r"text LLM's bare method\), not a diffusion stage's transformer \(it takes fp8, "
             r"int8, gguf\)"),
    ({"transformer": {"method": "int4"}}, r"transformer: int4 .* \(it takes fp8, int8, gguf\)"),
    ("text_encoder=int4", r"text_encoder: int4 quantizes an AR model .* not a diffusion "
                          r"stage's text_encoder \(it takes int8\)"),
    ({"vae": "int4"}, r"vae: int4 quantizes an AR model .* \(it takes none\)"),
])
def test_diffusion_components_refuse_int4(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DiffusionSettings(quantization=value)


def test_diffusion_stage_refuses_int4_with_its_path() -> None:
    with pytest.raises((ConfigError, ValueError),
                       match=r"stages\[0\].diffusion.quantization.*transformer: int4 "
                             r"quantizes an AR model"):
        stage("diffusion", "quantization: int4")
    with pytest.raises((ConfigError, ValueError), match="text_encoder: int4 quantizes an AR"):
        stage("ar", "quantization: {text_encoder: int4}")      # never an AR model's either
    assert stage("diffusion", "quantization: int8").diffusion.quantization == \
        Quantization(transformer="int8")


def test_flag_and_keyword(tiny_qwen3: Path) -> None:
    """`serve MODEL --quantization int4` and `Omni(..., quantization="int4")` reach an LLM's
    stage; the flag on a diffusion model (serve's default) is refused naming the component."""
    from omnistage.configs.defaults import resolve_graph
    from omnistage.engine.engine_args import apply_keywords
    from omnistage.entrypoints.cli import serve
    from omnistage.entrypoints.cli.main import parse_args

    def graph_of(argv: list[str]):
        args = parse_args(["serve", *argv])
        args.model = serve.model_name(args)
        path = serve.startup.resolve_model(args.model) if args.model else None
        return serve.build_graph(args, path)

    llm = graph_of([str(tiny_qwen3), "--quantization", "int4"]).stage("llm")
    assert llm.ar_config("m", "cpu").quantization == INT4
    graph = apply_keywords(resolve_graph(None, None, "llm"), {"quantization": "int4"})
    assert graph.stage("llm").ar_config("m", "cpu").quantization == INT4
    with pytest.raises(ValueError, match="transformer: int4 quantizes an AR model"):
        graph_of(["--quantization", "int4"])
