"""`quantization: {attention: fp8}` (issue 44): the DiT's attention in FP8, a component of the
quantization record in each of its forms (YAML, the `--quantization` flag, Python, `Omni`'s
keyword); refused for other methods, for AR stages, on a GPU older than 8.9, with ring
attention, and for a pipeline whose denoiser does not attend through SequenceSplit; and what
a model built under it takes (layers/sequence_parallel.py). Nothing loads a checkpoint
(tests/golden/diffusion/test_fp8_attention_stage.py serves a tiny Qwen-Image with it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.configs.defaults import resolve_graph
from omnistage.configs.quantization import ComponentQuantization, Quantization, ar_method
from omnistage.configs.schema import DiffusionSettings, ParallelSizes, StageConfig
from omnistage.configs.strict import ConfigError, from_dict, load_yaml
from omnistage.engine.engine_args import apply_keywords
from omnistage.entrypoints.cli import serve
from omnistage.entrypoints.cli.main import parse_args
from omnistage.layers.sequence_parallel import SequenceRanks, dit_attention
from omnistage.stages.quantize import (attention_method, attention_while_loading,
                                       check_components)

FP8 = ComponentQuantization("fp8")
BOTH = Quantization(transformer=FP8, attention=FP8)


def graph_of(argv: list[str]):  # type: ignore[no-untyped-def]
    """The graph `omnistage serve ARGV` would serve."""
    args = parse_args(["serve", *argv])
    args.model = serve.model_name(args)
    path = serve.startup.resolve_model(args.model) if args.model else None
    return serve.build_graph(args, path)


def settings(text: str) -> DiffusionSettings:
    return from_dict(DiffusionSettings, load_yaml(text), "stages[0].diffusion")


def dit_stage(quantization: str | None, **kw: object) -> StageConfig:
    return StageConfig(name="dit", kind="diffusion", component="qwen_image",
                       diffusion=DiffusionSettings(quantization=quantization), **kw)


@pytest.mark.parametrize("text, expected", [
    ("quantization: {transformer: fp8, attention: fp8}", BOTH),
    ("quantization: transformer=fp8,attention=fp8", BOTH),
    ("quantization: {attention: {method: fp8}}", Quantization(attention=FP8)),
    ("quantization: {attention: none}", None),
])
def test_yaml_forms(text: str, expected: Quantization | None) -> None:
    assert settings(text).quantization == expected


def test_flag_python_and_keyword() -> None:
    assert str(Quantization.parse("transformer=fp8,attention=fp8")) == (
        "transformer=fp8,attention=fp8")
    assert DiffusionSettings(quantization={"attention": "fp8"}).quantization == Quantization(
        attention=FP8)
    graph = graph_of(["--quantization", "transformer=fp8,attention=fp8"])
    assert graph.stage("dit").diffusion.quantization == BOTH
    split = apply_keywords(resolve_graph(None, None, "qwen_image_split"),
                           {"quantization": "attention=fp8"})
    assert str(split.stage("dit").diffusion.quantization) == "attention=fp8"


@pytest.mark.parametrize("text, message", [
    ("quantization: attention=int8",
     r"quantization: attention: int8 is not an attention method \(supported: fp8, none\)"),
    ("quantization: {attention: int4}", "attention: int4 is not an attention method"),
    ('quantization: {attention: "gguf:/x.gguf"}', "attention: gguf:/x.gguf is not an "
                                                  "attention method"),
])
def test_other_methods_refused(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        settings(text)


def test_ar_stages_refuse_attention(tiny_qwen3: Path) -> None:
    with pytest.raises(ValueError, match="attention: fp8 attention serves a diffusion stage's "
                                         "denoiser; an AR stage's paged attention is not "
                                         "quantized"):
        ar_method(Quantization(attention="fp8"), "qwen3_omni_thinker")
    with pytest.raises(ValueError, match=r"ar.quantization.attention: fp8 attention serves a "
                                         r"diffusion stage's denoiser"):
        graph_of([str(tiny_qwen3), "--quantization", "transformer=fp8,attention=fp8"])


def test_where_fp8_attention_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert attention_method(dit_stage(None), cuda) == "sdpa"
    assert attention_method(dit_stage("transformer=fp8"), cuda) == "sdpa"
    assert attention_method(dit_stage("attention=fp8"), cpu) == "fp8"        # the emulation
    check_components(dit_stage("attention=fp8"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    assert attention_method(dit_stage("attention=fp8"), cuda) == "fp8"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    with pytest.raises(ValueError, match=r"stage 'dit': quantization.attention: fp8 needs a "
                                         r"GPU of compute capability 8.9\+ \(Ada, Hopper\); "
                                         r"cuda:0 has 8.0"):
        attention_method(dit_stage("attention=fp8"), cuda)
    with pytest.raises(ValueError, match="quantization.attention: fp8 runs on CUDA"):
        attention_method(dit_stage("attention=fp8"), torch.device("meta"))
    ring = dit_stage("attention=fp8", parallel=ParallelSizes(ring=2))
    with pytest.raises(ValueError, match=r"quantization.attention: fp8: ring attention \(ring "
                                         r"2\) has no fp8 form"):
        attention_method(ring, cpu)
    attention_method(dit_stage("attention=fp8", parallel=ParallelSizes(ulysses=2)), cpu)


def test_models_built_under_it_take_it() -> None:
    stage, cpu = dit_stage("attention=fp8"), torch.device("cpu")
    with attention_while_loading(stage, cpu):
        inside = SequenceRanks.current()
    assert (inside.attention, SequenceRanks.current().attention) == ("fp8", "sdpa")
    with attention_while_loading(dit_stage(None), cpu):
        assert SequenceRanks.current().attention == "sdpa"
    with pytest.raises(ValueError, match=r"stage 'dit': quantization.attention: fp8 is served "
                                         r"for denoisers that attend through "
                                         r"layers/sequence_parallel.py .*this pipeline's does "
                                         r"not"):
        with attention_while_loading(stage, cpu):
            pass                            # no model built: SD3, GLM-Image, LTX-2
    with dit_attention("fp8") as built:
        SequenceRanks.current()
        SequenceRanks.current()
    assert built.num_models == 2
