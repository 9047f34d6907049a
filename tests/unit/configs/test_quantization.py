"""The per-component `quantization` record (configs/quantization.py) in each of its forms: the
graph YAML, the `--quantization` flag's string, Python keywords; strict errors naming the
field; a diffusion stage refusing what it cannot apply, by component, before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.configs.quantization import ComponentQuantization, Quantization
from omnistage.configs.schema import DiffusionSettings, StageConfig
from omnistage.configs.strict import ConfigError, from_dict, load_yaml
from omnistage.stages.quantize import check_components

GGUF = ComponentQuantization("gguf", "/models/flux1-dev-Q4_K_S.gguf")


def settings(text: str) -> DiffusionSettings:
    return from_dict(DiffusionSettings, load_yaml(text), "stages[0].diffusion")


@pytest.mark.parametrize("text, expected", [
    ("quantization: fp8", Quantization(transformer=ComponentQuantization("fp8"))),
    ("quantization: {transformer: int8, text_encoder: int8}",
     Quantization(transformer=ComponentQuantization("int8"),
                  text_encoder=ComponentQuantization("int8"))),
    ('quantization: {transformer: "gguf:/models/flux1-dev-Q4_K_S.gguf"}',
     Quantization(transformer=GGUF)),
    ("quantization: {transformer: {method: gguf, file: /models/flux1-dev-Q4_K_S.gguf}}",
     Quantization(transformer=GGUF)),
    ("quantization: transformer=gguf:/models/flux1-dev-Q4_K_S.gguf,vae=none",
     Quantization(transformer=GGUF)),
    ("quantization: {transformer: none}", None),
    ("quantization: none", None),
    ("max_num_seqs: 2", None),
])
def test_forms_read_the_same(text: str, expected: Quantization | None) -> None:
    assert settings(text).quantization == expected


def test_python_forms() -> None:
    assert DiffusionSettings(quantization="int8").quantization == Quantization(
        transformer="int8")
    assert str(Quantization.parse("transformer=fp8, text_encoder=int8")) == (
        "transformer=fp8,text_encoder=int8")
    assert str(Quantization(transformer=GGUF)) == (
        "transformer=gguf:/models/flux1-dev-Q4_K_S.gguf")
    assert Quantization(talker="int8").items() == {"talker": ComponentQuantization("int8")}
    assert DiffusionSettings(quantization={"transformer": {"method": "gguf", "file": "a.gguf"}}
                             ).quantization == Quantization(transformer="gguf:a.gguf")
    with pytest.raises(ValueError, match=r"quantization: transformr: unknown key \(did you"):
        DiffusionSettings(quantization={"transformr": "int8"})


@pytest.mark.parametrize("text, message", [
    ("quantization: fp9", r"stages\[0\].diffusion.quantization: transformer: .fp9. is not one"),
    ("quantization: {transformr: int8}",
     r"quantization.transformr: unknown key \(did you mean transformer\?\)"),
    ("quantization: {transformer: {method: gguf}}",
     "quantization.transformer.file: the gguf method needs the .gguf file"),
    ("quantization: {transformer: {method: int8, file: a.gguf}}",
     "file: only the gguf method reads a file, not int8"),
    ("quantization: {transformer: {method: int2}}", "method: 'int2' is not one of"),
    ("quantization: unet=int8", "'unet=int8': expected COMPONENT=METHOD with COMPONENT one of"),
    ("quantization: 3", "quantization: expected"),
])
def test_bad_values_name_the_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        settings(text)


@pytest.mark.parametrize("spec, message", [
    ("vae=int8", "quantization.vae: a diffusion stage quantizes its transformer, "
                 "text_encoder and attention, not its vae"),
    ("thinker=int8", "quantization.thinker: a diffusion stage quantizes its transformer, "
                     "text_encoder and attention, not its thinker"),
    ("text_encoder=fp8", r"quantization.text_encoder: fp8 is not applied to a text_encoder "
                         r"\(supported: int8\)"),
    ("transformer=gguf:/nowhere/x.gguf", "quantization.transformer: GGUF file "
                                         "/nowhere/x.gguf not found"),
])
def test_diffusion_stage_refuses_by_component(spec: str, message: str) -> None:
    stage = StageConfig(name="dit", kind="diffusion", component="flux",
                        diffusion=DiffusionSettings(quantization=spec))
    with pytest.raises(ValueError, match=f"stage 'dit': {message}"):
        check_components(stage)


def test_diffusion_stage_takes_what_it_applies(tmp_path: Path) -> None:
    (tmp_path / "t.gguf").write_bytes(b"")
    for spec in ("fp8", "int8", f"gguf:{tmp_path / 't.gguf'}", "transformer=int8,"
                 "text_encoder=int8"):
        check_components(StageConfig(name="dit", kind="diffusion", component="flux",
                                     diffusion=DiffusionSettings(quantization=spec)))
