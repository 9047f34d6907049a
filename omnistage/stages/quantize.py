"""A diffusion stage's `quantization` record (configs/quantization.py) applied to the pipeline
it loaded, component by component:

    transformer   fp8   every denoiser's large linears in FP8 (layers/fp8.py)
                  int8  every denoiser's large linears in INT8 W8A8 (layers/int8.py)
                  gguf  the denoiser rebuilt from the GGUF file (models/gguf_loader.py): its
                        quantized linears stay blocks; one denoiser only (not Wan 2.2's two)
    text_encoder  int8  the prompt encoder's networks' large linears in INT8

The VAE (convolutions) and the AR components (thinker, talker) are refused by name here,
before anything loads (`check_components`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from omnistage.configs.quantization import ComponentQuantization, Quantization
from omnistage.configs.schema import StageConfig
from omnistage.diffusion.latent_pipeline import LatentPipelineBase
from omnistage.layers.fp8 import quantize_fp8
from omnistage.layers.int8 import quantize_int8
from omnistage.models.gguf_loader import build_from_gguf

# component -> the methods a diffusion stage applies to it
APPLIES = {"transformer": ("fp8", "int8", "gguf"), "text_encoder": ("int8",)}


def check_components(stage: StageConfig) -> None:
    """ValueError naming the stage and the component for what a diffusion stage cannot
    apply (a VAE, an AR model, fp8 on a text encoder, a GGUF file that is not there)."""
    q = stage.diffusion.quantization
    for name, c in (q.items() if isinstance(q, Quantization) else {}).items():
        where = f"stage {stage.name!r}: quantization.{name}"
        if name not in APPLIES:
            raise ValueError(f"{where}: a diffusion stage quantizes its "
                             f"{' and '.join(APPLIES)}, not its {name}")
        if c.method not in APPLIES[name]:
            raise ValueError(f"{where}: {c.method} is not applied to a {name} "
                             f"(supported: {', '.join(APPLIES[name])})")
        if c.method == "gguf" and not Path(c.file).is_file():
            raise ValueError(f"{where}: GGUF file {c.file} not found")


def quantize_pipeline(stage: StageConfig, pipeline: object, dev: torch.device) -> None:
    """The stage's quantization on the loaded pipeline (module docstring); the replaced
    weights are freed."""
    q = stage.diffusion.quantization
    if q is None:
        return
    check_components(stage)
    items = q.items()
    if "transformer" in items:
        _transformer(pipeline, items["transformer"], dev)
    if "text_encoder" in items:
        for model in _text_encoders(stage, pipeline):
            quantize_int8(model)
    if dev.type == "cuda":
        torch.cuda.empty_cache()          # the replaced weights' blocks back to the device


def _transformer(pipeline: object, c: ComponentQuantization, dev: torch.device) -> None:
    denoisers = pipeline.denoisers()
    if c.method == "gguf":
        if not isinstance(pipeline, LatentPipelineBase) or denoisers != [pipeline.transformer]:
            raise ValueError(f"quantization gguf: a GGUF file replaces the one transformer of "
                             f"an image pipeline (FLUX.1, Qwen-Image, SD3, Z-Image), not "
                             f"{type(pipeline).__name__}'s")
        old = denoisers[0]
        dtype = next(p.dtype for p in old.parameters() if p.is_floating_point())
        pipeline.transformer = build_from_gguf(type(old), old.cfg, Path(c.file), dev, dtype)
        return
    for model in denoisers:
        quantize_fp8(model) if c.method == "fp8" else quantize_int8(model)


def _text_encoders(stage: StageConfig, pipeline: object) -> list[nn.Module]:
    """The networks of the pipeline's prompt encoder (CLIP, T5, Qwen2.5-VL, ...)."""
    encoder = pipeline.prompt_encoder if isinstance(pipeline, LatentPipelineBase) else None
    if encoder is None:
        raise ValueError(f"stage {stage.name!r}: quantization.text_encoder: this stage "
                         "loads no text encoder (it runs in another stage, or the pipeline "
                         "has none of its own)")
    return [m for m in vars(encoder).values() if isinstance(m, nn.Module)]
