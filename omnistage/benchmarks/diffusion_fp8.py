"""The FP8 (and INT8) variant of `omnistage bench diffusion` (`--quantization fp8|int8`, issues
23 and 44; the keys below say fp8, int8's have its prefix): our Qwen-Image
transformer after `quantize_fp8` (layers/fp8.py), against diffusers eager and compiled (timed in
the same call by diffusion.py) and against our own bf16 image.

    1. transformer  the same Euler loop as diffusion.py's (same latents, captions and schedule)
                    with FP8 linears, eager and, with --compile, its blocks compiled: seconds
    2. engine       the bf16 engine's uncached request again: its image's PSNR (peak 255) and
                    per-pixel error against the bf16 image; with step caching at each
                    threshold, seconds and image PSNR; the fastest at >= 28 dB
    3. memory       the transformer's weight bytes in bf16 and in FP8; the peak during the loop

Headline ratios, by the issue's names: fp8_speedup_vs_diffusers_compiled (diffusers' compiled
loop over our fastest FP8 loop), fp8_image_psnr_db, fp8_cache_speedup_vs_diffusers_compiled
(diffusers' compiled loop over the fastest cached FP8 engine image at >= 28 dB; the engine's
time includes the VAE decode, so this ratio errs against us). Targets on an H100: 1.6x at
30 dB or more, 3x with caching at 28 dB or more.

FP8 attention (`--quantization transformer=fp8,attention=fp8`, or `attention=fp8` alone; issue
44): the transformer's attention through layers/fp8_attention.py (Q and K in e4m3; the kernel
on a GPU of capability 8.9+, its float32 emulation on the CPU), with or without the FP8
linears; the keys keep the fp8_ prefix (int8_ with int8 linears), `attention` says which
attention ran, and fp8_latents_psnr_db compares the loop's final latents with our bf16 loop's.

The tiny preset (CPU, CI) quantizes every linear from 16 features up (the real threshold leaves
none of the tiny ones) and runs `_scaled_mm` on the CPU: its figures check the plumbing only.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import Tensor, nn

from omnistage.benchmarks.common import free_device_memory, ratio
from omnistage.benchmarks.diffusion import (DiffusionBenchConfig, _pipeline, _serve,
                                            best_cached, denoiser_inputs, psnr, request_params,
                                            split_quantization)
from omnistage.layers.fp8 import MIN_FEATURES, quantize_fp8
from omnistage.layers.int8 import quantize_int8

GIB = 1 << 30
FP8_CACHE_MIN_DB = 28.0


def weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def bench_fp8(transformer: nn.Module, image: Tensor, reference: dict[str, object],
              cfg: DiffusionBenchConfig, device: torch.device, dtype: torch.dtype
              ) -> dict[str, object]:
    """Quantize `transformer` (in place) and measure it; `image` is the bf16 engine's uncached
    image, `reference` the transformer timings (diffusers eager and compiled)."""
    from omnistage.diffusion.pipeline import compile_blocks

    linears, attention = split_quantization(cfg.quantization)
    q = linears or "fp8"                                   # the keys' prefix
    _, text, timed = denoiser_inputs(cfg, device, dtype)
    grid = cfg.size // 16

    def forward(x: Tensor, t: Tensor) -> Tensor:
        return transformer(x, text, None, t, img_shapes=[[(1, grid, grid)]])

    bf16_latents, _ = timed(forward)                       # unquantized (bf16 on a GPU)
    out = _quantize(transformer, linears, attention, cfg.sizes == "tiny")
    free_device_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    latents, out[f"{q}_s"] = timed(forward)
    out[f"{q}_latents_psnr_db"] = psnr(latents.float(), bf16_latents.float())
    if device.type == "cuda":
        out[f"{q}_peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    if cfg.compile:                                 # stays compiled for the engine below
        t0 = time.perf_counter()
        compile_blocks(transformer)
        _, out[f"{q}_compiled_s"] = timed(forward)
        out[f"{q}_compile_and_warmup_s"] = time.perf_counter() - t0 - out[f"{q}_compiled_s"]
    out["engine"] = _engine(transformer, text[0], image, cfg, device, dtype)
    best_s = out.get(f"{q}_compiled_s", out[f"{q}_s"])
    cached = out["engine"]["step_cache_best_at_28db"]
    compiled_s = reference["diffusers_compiled_s"]
    out["ratios"] = {
        f"{q}_speedup_vs_diffusers": ratio(reference["diffusers_s"], best_s),
        f"{q}_speedup_vs_diffusers_compiled": ratio(compiled_s, best_s),
        f"{q}_image_psnr_db": out["engine"]["image_psnr_db"],
        f"{q}_latents_psnr_db": out[f"{q}_latents_psnr_db"],
        f"{q}_cache_speedup_vs_diffusers_compiled": ratio(compiled_s, cached["seconds"])
        if cached else None,
        f"{q}_cache_image_psnr_db": cached["image_psnr_db"] if cached else None,
        f"{q}_weights_vs_bf16": ratio(out[f"weights_gib_{q}"], out["weights_gib_bf16"])}
    return out


def _quantize(transformer: nn.Module, linears: str | None, attention: str | None,
              tiny: bool) -> dict[str, object]:
    """The linears in `linears` (fp8, int8; every one from 16 features in the tiny model) and
    the attention in fp8 where `attention` says so, in place: -> weight figures."""
    q = linears or "fp8"
    out: dict[str, object] = {"weights_gib_bf16": weight_bytes(transformer) / GIB,
                              "attention": attention or "sdpa"}
    floor = 16 if tiny else MIN_FEATURES
    swapped = []
    if linears == "fp8":
        swapped = quantize_fp8(transformer, min_features=floor, allow_cpu=tiny)
    elif linears == "int8":
        swapped = quantize_int8(transformer, min_features=floor)
    if attention:        # what a stage's `attention_while_loading` fixes at build time
        transformer.seq_ranks = replace(transformer.seq_ranks, attention=attention)
    out.update({f"num_{q}_linears": len(swapped),
                f"weights_gib_{q}": weight_bytes(transformer) / GIB})
    return out


def _engine(transformer: nn.Module, text: Tensor, image: Tensor, cfg: DiffusionBenchConfig,
            device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    """The bf16 engine's uncached request through the FP8 transformer, then cached at each
    threshold: seconds and the image against bf16's. No warm-up request: the loop above warmed
    the transformer, the bf16 engine the VAE."""
    from omnistage.diffusion.engine import DiffusionEngine

    pipe = _pipeline(transformer, cfg, device, dtype)
    engine = DiffusionEngine(pipe, max_num_seqs=1)
    seconds, _, images, _ = _serve(engine, pipe, [("fp8", request_params(cfg, 0))], text,
                                   device)
    error = (images["fp8"].float() - image.float()).abs()            # per pixel and channel
    cache = []
    for thr in cfg.cache_thresholds:
        s, _, img, met = _serve(engine, pipe, [("cached", request_params(cfg, 0, thr))], text,
                                device)
        cache.append({"threshold": thr, "seconds": s,
                      "steps_skipped": met["cached"].num_steps_skipped, "speedup": ratio(
                          seconds, s), "image_psnr_db": psnr(img["cached"].float(),
                                                             image.float(), 255.0)})
    return {"seconds_per_image": seconds,
            "image_psnr_db": psnr(images["fp8"].float(), image.float(), 255.0),
            "pixel_error": {"mean": float(error.mean()), "p99": float(error.quantile(0.99)),
                            "max": float(error.max())},
            "step_cache": cache,
            "step_cache_best_at_28db": best_cached(cache, "image_psnr_db", FP8_CACHE_MIN_DB)}
