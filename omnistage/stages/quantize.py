"""A diffusion stage's `quantization` record (configs/quantization.py) applied to the pipeline
it loaded, component by component:

    transformer   fp8   every denoiser's large linears in FP8 (layers/fp8.py)
                  int8  every denoiser's large linears in INT8 W8A8 (layers/int8.py)
                  gguf  the denoiser rebuilt from the GGUF file (models/gguf_loader.py): its
                        quantized linears stay blocks; one denoiser only (not Wan 2.2's two)
    text_encoder  int8  the prompt encoder's networks' large linears in INT8
    attention     fp8   the denoisers' attention with Q and K in e4m3 (layers/fp8_attention.py):
                        fixed as they are built (`attention_while_loading` around the load),
                        the kernel on CUDA 8.9+, its float32 emulation on CPU; refused on an
                        older GPU, with ring attention, and for a pipeline whose denoiser does
                        not attend through layers/sequence_parallel.py (SD3, GLM-Image, LTX-2)

The VAE (convolutions) and the AR components (thinker, talker) are refused by name here,
before anything loads (`check_components`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from omnistage.configs.quantization import ComponentQuantization, Quantization
from omnistage.configs.schema import StageConfig
from omnistage.diffusion.latent_pipeline import LatentPipelineBase
from omnistage.layers.fp8 import quantize_fp8
from omnistage.layers.sequence_parallel import dit_attention
from omnistage.layers.int8 import quantize_int8
from omnistage.models.gguf_loader import build_from_gguf

# component -> the methods a diffusion stage applies to it
APPLIES = {"transformer": ("fp8", "int8", "gguf"), "text_encoder": ("int8",),
           "attention": ("fp8",)}
FP8_ATTENTION_CAPABILITY = (8, 9)


def check_components(stage: StageConfig) -> None:
    """ValueError naming the stage and the component for what a diffusion stage cannot
    apply (a VAE, an AR model, fp8 on a text encoder, a GGUF file that is not there)."""
    q = stage.diffusion.quantization
    for name, c in (q.items() if isinstance(q, Quantization) else {}).items():
        where = f"stage {stage.name!r}: quantization.{name}"
        if name not in APPLIES:
            *others, last = APPLIES
            raise ValueError(f"{where}: a diffusion stage quantizes its "
                             f"{', '.join(others)} and {last}, not its {name}")
        if c.method not in APPLIES[name]:
            raise ValueError(f"{where}: {c.method} is not applied to a {name} "
                             f"(supported: {', '.join(APPLIES[name])})")
        if c.method == "gguf" and not Path(c.file).is_file():
            raise ValueError(f"{where}: GGUF file {c.file} not found")


def attention_method(stage: StageConfig, dev: torch.device) -> str:
    """What the stage's DiTs attend with: "fp8" for `quantization.attention: fp8` where it
    runs (CUDA 8.9+, or the CPU emulation), else "sdpa". ValueError naming the stage and the
    component where it cannot run."""
    q = stage.diffusion.quantization
    if not isinstance(q, Quantization) or q.attention is None:
        return "sdpa"
    where = f"stage {stage.name!r}: quantization.attention: fp8"
    if dev.type == "cuda":
        capability = torch.cuda.get_device_capability(dev)
        if capability < FP8_ATTENTION_CAPABILITY:
            raise ValueError(f"{where} needs a GPU of compute capability 8.9+ (Ada, Hopper); "
                             f"{dev} has {capability[0]}.{capability[1]}")
    elif dev.type != "cpu":
        raise ValueError(f"{where} runs on CUDA (8.9+) or, emulated, on CPU; not on {dev}")
    if stage.parallel.ring > 1:
        raise ValueError(f"{where}: ring attention (ring {stage.parallel.ring}) has no fp8 "
                         "form; use ulysses for sequence parallelism")
    return "fp8"


@contextlib.contextmanager
def attention_while_loading(stage: StageConfig, dev: torch.device) -> Iterator[None]:
    """Around the loading of the stage's pipeline: its DiTs attend as `attention_method`
    says. ValueError naming the component if none of them took fp8 attention (a denoiser that
    does not attend through layers/sequence_parallel.py)."""
    method = attention_method(stage, dev)
    with dit_attention(method) as built:
        yield
    if method != "sdpa" and built.num_models == 0:
        raise ValueError(f"stage {stage.name!r}: quantization.attention: fp8 is served for "
                         "denoisers that attend through layers/sequence_parallel.py (Qwen-"
                         "Image, FLUX.1, FLUX.2, Z-Image, Wan, HunyuanVideo 1.5); this "
                         "pipeline's does not")


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
    # attention: fixed while the models were built (attention_while_loading)
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
