"""`quantization: fp8` from the outside in: the stage key, the `--quantization` flag and the
`quantization=` keyword reach a diffusion graph's main stage and an LLM's (an AR stage: its
model), and are refused for stages without a native transformer; a stage on a device without
FP8 refuses to start. Nothing loads a checkpoint (layers/test_fp8.py runs the FP8 path itself)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from omnistage.configs.defaults import resolve_graph
from omnistage.configs.quantization import ComponentQuantization
from omnistage.configs.schema import DiffusionSettings, StageConfig
from omnistage.engine.engine_args import apply_keywords
from omnistage.entrypoints.cli import serve
from omnistage.entrypoints.cli.main import parse_args
from omnistage.stages.diffusion import check_quantization, quantize_pipeline


def graph_of(argv: list[str]):
    args = parse_args(["serve", *argv])
    args.model = serve.model_name(args)
    path = serve.startup.resolve_model(args.model) if args.model else None
    return serve.build_graph(args, path)


def test_flag_and_keyword_set_the_main_stage(tiny_qwen3: Path) -> None:
    assert str(graph_of(["--quantization", "fp8"]).stage("dit").diffusion.quantization) == (
        "transformer=fp8")
    split = apply_keywords(resolve_graph(None, None, "qwen_image_split"),
                           {"quantization": "fp8"})
    assert (str(split.stage("dit").diffusion.quantization),
            split.stage("text_encoder").diffusion.quantization) == (
        "transformer=fp8", None)                                  # the denoiser, not the text encoder
    # an AR main stage reads it too (ar/quantize.py): the LLM's model, a bare method
    assert str(graph_of([str(tiny_qwen3), "--quantization", "fp8"]).stage("llm")
               .ar.quantization) == "transformer=fp8"
    llm = apply_keywords(resolve_graph(None, None, "llm"), {"quantization": "int8"})
    assert llm.stage("llm").ar_config("m", "cpu").quantization == ComponentQuantization("int8")
    with pytest.raises(ValueError, match=r"ar.quantization.text_encoder: this AR stage loads "
                                         r"the transformer"):
        graph_of([str(tiny_qwen3), "--quantization", "text_encoder=int8"])


def test_stage_refusals() -> None:
    from omnistage.diffusion.diffusers_pipeline import DiffusersPipeline
    from omnistage.diffusion.pipeline import DiffusionPipeline

    stage = StageConfig(name="dit", kind="diffusion", component="qwen_image",
                        diffusion=DiffusionSettings(quantization="fp8"))
    with pytest.raises(ValueError, match="not to a text-encoder stage"):
        check_quantization(stage, DiffusionPipeline, "text_encoder")
    with pytest.raises(ValueError, match="not to the generic diffusers adapter"):
        check_quantization(stage, DiffusersPipeline, "")
    check_quantization(stage, DiffusionPipeline, "")

    class Tiny(nn.Sequential):
        fp8_keep = ()

    pipeline = SimpleNamespace(denoisers=lambda: [Tiny(nn.Linear(1024, 1024))])
    with pytest.raises(ValueError, match="runs on CUDA GPUs of compute capability 8.9 or newer; "
                                         "this model is on cpu"):
        quantize_pipeline(stage, pipeline, torch.device("cpu"))
    quantize_pipeline(StageConfig(name="dit", kind="diffusion"), pipeline, torch.device("cpu"))
