"""The GGUF variant of `omnistage bench diffusion` (`--quantization gguf`, issue 44): our
Qwen-Image transformer with every eligible linear's weight quantized to GGUF blocks and kept
as blocks (layers/gguf.py's GGUFLinear, dequantized on every call), in two formats, against
our own bf16 transformer on the same random weights:

    q8  Q8_0  32 weights in 34 bytes   (34/64 of bf16)
    q4  Q4_0  32 weights in 18 bytes   (18/64 of bf16); gguf 0.19's `gguf.quants.quantize`
              has no Q4_K writer (K-quants it only reads), so the 4-bit format is Q4_0

    1. quantize  every linear whose inputs split into 32-weight blocks, from the bf16 weight,
                 both formats at once (`quantize_q8_0` / `quantize_q4_0`: torch, on the
                 device, bit for bit `gguf.quants.quantize`, whose numpy takes minutes at
                 20B weights); the Q4 blocks wait on the CPU while Q8 is measured
                 (`quantize_s`: both formats and that copy)
    2. loop      the same Euler loop as diffusion.py's (same latents, captions, schedule),
                 bf16 first, then each format: seconds, the peak memory during the loop,
                 and the final latents' PSNR against bf16's
    3. engine    the bf16 engine's uncached request (diffusion.py's) again through each
                 format: the image's PSNR (peak 255) and per-pixel error against bf16's
    4. memory    the transformer's weight bytes with every float tensor counted at 2 bytes
                 (bf16, whatever dtype the run computes in) and every block at its bytes:
                 the whole transformer's ratio to bf16, and the quantized linears' weights'
                 alone (exactly 34/64 and 18/64)

Headline ratios, by the issue's names: gguf_q8_image_psnr_db (target >= 35 dB),
gguf_q4_memory_ratio (target <= 0.35), gguf_q4_image_psnr_db, gguf_q8_memory_ratio,
gguf_{q8,q4}_speedup_vs_diffusers_compiled (diffusers' compiled loop, timed in the same call
by diffusion.py, over the format's fastest loop: with --compile, its blocks compiled as well)
and gguf_{q8,q4}_speedup_vs_bf16 (eager over eager; below 1: slower, as there is no fused
dequant-matmul kernel yet and every call dequantizes the whole weight).

The tiny preset (CPU, CI) runs in float32; its linears of 16 inputs do not split into blocks
and stay plain, so its whole-model ratios sit above 34/64 and 18/64.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import Tensor, nn

from omnistage.benchmarks.common import free_device_memory, ratio
from omnistage.benchmarks.diffusion import (DiffusionBenchConfig, Timed, _pipeline, _serve,
                                            denoiser_inputs, psnr, request_params)
from omnistage.layers.fp8 import LINEARS
from omnistage.layers.gguf import FORMATS, GGUFLinear

GIB = 1 << 30
Q8_0, Q4_0 = 8, 2                              # ggml type ids
BLOCK = 32                                     # weights per block, both formats
RUN_FORMATS = {"q8": Q8_0, "q4": Q4_0}         # the keys' infix -> ggml type
Forward = Callable[[Tensor, Tensor], Tensor]   # (latents, timestep) -> velocity


# ---- torch quantizers, bit for bit gguf.quants' (ggml-quants.c's reference) --------------

def _blocks(w: Tensor) -> Tensor:
    assert w.shape[-1] % BLOCK == 0, f"{tuple(w.shape)}: inputs not a multiple of {BLOCK}"
    return w.float().reshape(-1, BLOCK)                                      # (B, 32)


def _inverse(d: Tensor) -> Tensor:
    """1 / d, 0 where d is 0 (an all-zero block)."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _roundf(x: Tensor) -> Tensor:
    """C's roundf (half away from zero) in gguf's formulation, so that ties round alike."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def quantize_q8_0(w: Tensor) -> Tensor:
    """(N, K) float -> Q8_0 blocks uint8 (N, K / 32 * 34): d = max|w| / 127 (float16),
    q = round(w / d) (int8)."""
    b = _blocks(w)
    d = b.abs().amax(1, keepdim=True) / 127                                # (B, 1)
    q = _roundf(b * _inverse(d)).to(torch.int8)                            # (B, 32)
    out = torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], 1)  # (B, 34)
    return out.reshape(w.shape[0], -1)


def quantize_q4_0(w: Tensor) -> Tensor:
    """(N, K) float -> Q4_0 blocks uint8 (N, K / 32 * 18): d = (the signed weight of largest
    magnitude) / -8 (float16), q = trunc(w / d + 8.5) clipped to 0..15, weights 0-15 in the
    low nibbles and 16-31 in the high ones."""
    b = _blocks(w)
    peak = b.gather(1, b.abs().argmax(1, keepdim=True))                    # (B, 1), signed
    d = peak / -8
    q = torch.trunc(b * _inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)   # (B, 32)
    packed = q[:, :BLOCK // 2] | (q[:, BLOCK // 2:] << 4)                  # (B, 16)
    return torch.cat([d.half().view(torch.uint8), packed], 1).reshape(w.shape[0], -1)


QUANTIZE = {Q8_0: quantize_q8_0, Q4_0: quantize_q4_0}


def quantize(w: Tensor, qtype: int) -> Tensor:
    """A linear's weight (N, K) as GGUF blocks of `qtype` (Q8_0 or Q4_0), on w's device."""
    if qtype not in QUANTIZE:
        raise ValueError(f"GGUF type {qtype} has no quantizer here (Q8_0: 8, Q4_0: 2)")
    return QUANTIZE[qtype](w)


# ---- the transformer's linears as blocks --------------------------------------------------

def eligible_linears(model: nn.Module) -> list[str]:
    """The linears whose inputs split into whole blocks (the others stay as they are)."""
    return [name for name, m in model.named_modules()
            if isinstance(m, LINEARS) and m.weight.shape[1] % BLOCK == 0]


def bytes_at_bf16(tensors: list[Tensor]) -> int:
    """Float tensors at 2 bytes per value (bf16), others (GGUF blocks) at their own bytes."""
    return sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in tensors)


def model_bytes(model: nn.Module) -> int:
    return bytes_at_bf16([*model.parameters(), *model.buffers()])


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)


def quantize_linears(model: nn.Module, names: list[str]) -> tuple[dict[str, Tensor], float]:
    """Replace each linear in `names` by a Q8_0 GGUFLinear (in place, freeing its weight) and
    return the same weights as Q4_0 blocks on the CPU, and the seconds both took."""
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    q4: dict[str, Tensor] = {}
    with torch.no_grad():
        for name in names:
            linear = model.get_submodule(name)
            w, bias = linear.weight.detach(), linear.bias
            q4[name] = quantize_q4_0(w).to("cpu")
            _swap(model, name, GGUFLinear(quantize_q8_0(w), Q8_0, w.shape[1],
                                          None if bias is None else bias.detach()))
    sync()
    return q4, time.perf_counter() - t0


def to_q4(model: nn.Module, q4: dict[str, Tensor]) -> None:
    """Each Q8_0 GGUFLinear in `q4` becomes the Q4_0 one of the same weight (same bias)."""
    for name, blocks in q4.items():
        old = model.get_submodule(name)
        assert isinstance(old, GGUFLinear), f"{name}: {type(old).__name__}, not a GGUFLinear"
        _swap(model, name, GGUFLinear(blocks.to(old.qweight.device), Q4_0, old.in_features,
                                      old.bias))


def linear_bytes(model: nn.Module, names: list[str]) -> int:
    """The weights of the linears `names` (blocks or float at bf16), biases left out."""
    def weight(m: nn.Module) -> Tensor:
        return m.qweight if isinstance(m, GGUFLinear) else m.weight

    return bytes_at_bf16([weight(model.get_submodule(n)) for n in names])


# ---- the run ------------------------------------------------------------------------------

def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    free_device_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _image(engine, pipe, text: Tensor, cfg: DiffusionBenchConfig, device: torch.device,
           key: str) -> tuple[Tensor, float]:
    """The engine's uncached request of the run (diffusion.py's seed): -> image, seconds."""
    seconds, _, images, _ = _serve(engine, pipe, [(key, request_params(cfg, 0))], text, device)
    return images[key], seconds


def _measure(key: str, timed: Timed, forward: Forward, engine, pipe, text: Tensor, image: Tensor,
             bf16_latents: Tensor, cfg: DiffusionBenchConfig, device: torch.device
             ) -> dict[str, object]:
    """One format's loop and engine image against bf16's."""
    _reset_peak(device)
    latents, seconds = timed(forward)
    peak = _peak_gib(device)
    img, image_s = _image(engine, pipe, text, cfg, device, key)
    error = (img.float() - image.float()).abs()                      # per pixel and channel
    return {"seconds": seconds, "peak_gib": peak,
            "latents_psnr_db": psnr(latents.float(), bf16_latents.float()),
            "engine": {"seconds_per_image": image_s,
                       "image_psnr_db": psnr(img.float(), image.float(), 255.0),
                       "pixel_error": {"mean": float(error.mean()),
                                       "p99": float(error.quantile(0.99)),
                                       "max": float(error.max())}}}


def bench_gguf(transformer: nn.Module, image: Tensor, reference: dict[str, object],
               cfg: DiffusionBenchConfig, device: torch.device, dtype: torch.dtype
               ) -> dict[str, object]:
    """Quantize `transformer` (in place: Q8_0, then Q4_0) and measure it; `image` is the bf16
    engine's uncached image, `reference` the transformer timings (diffusers eager and, when
    timed, compiled)."""
    from omnistage.diffusion.engine import DiffusionEngine

    _, text, timed = denoiser_inputs(cfg, device, dtype)
    grid = cfg.size // 16

    def forward(x: Tensor, t: Tensor) -> Tensor:
        return transformer(x, text, None, t, img_shapes=[[(1, grid, grid)]])

    _reset_peak(device)
    bf16_latents, bf16_s = timed(forward)                   # unquantized (bf16 on a GPU)
    out: dict[str, object] = {"formats": {k: FORMATS[q][0] for k, q in RUN_FORMATS.items()},
                              "bf16_s": bf16_s, "bf16_peak_gib": _peak_gib(device)}
    names = eligible_linears(transformer)
    num_linears = sum(isinstance(m, LINEARS) for m in transformer.modules())
    out.update(num_gguf_linears=len(names), num_linears_kept=num_linears - len(names),
               weights_gib_bf16=model_bytes(transformer) / GIB,
               linears_gib_bf16=linear_bytes(transformer, names) / GIB)
    q4, out["quantize_s"] = quantize_linears(transformer, names)
    pipe = _pipeline(transformer, cfg, device, dtype)           # the bf16 engine's VAE weights
    engine = DiffusionEngine(pipe, max_num_seqs=1)
    for key in RUN_FORMATS:
        if key == "q4":
            to_q4(transformer, q4)
            q4 = {}
        out[f"weights_gib_{key}"] = model_bytes(transformer) / GIB
        out[f"linears_gib_{key}"] = linear_bytes(transformer, names) / GIB
        out[key] = _measure(key, timed, forward, engine, pipe, text[0], image, bf16_latents,
                            cfg, device)
        if cfg.compile:
            out[key].update(_compiled(transformer, timed, forward))
    out["ratios"] = _ratios(out, reference)
    return out


def _compiled(transformer: nn.Module, timed: Timed, forward: Forward) -> dict[str, float]:
    """The loop again with the blocks compiled (inductor fuses each dequantization into one
    kernel), then the eager blocks put back for the next format's swap."""
    from omnistage.diffusion.pipeline import compile_blocks, uncompile_blocks

    t0 = time.perf_counter()
    compile_blocks(transformer)
    _, seconds = timed(forward)                                      # its warm-up compiles
    total = time.perf_counter() - t0
    uncompile_blocks(transformer)
    torch._dynamo.reset()               # the compiled code must not keep the blocks alive
    return {"compiled_s": seconds, "compile_and_warmup_s": total - seconds}


def _ratios(out: dict[str, object], reference: dict[str, object]) -> dict[str, object]:
    """The headline figures, prefixed gguf_q8_ / gguf_q4_."""
    ratios: dict[str, object] = {}
    for key in RUN_FORMATS:
        run = out[key]
        best_s = run.get("compiled_s", run["seconds"])
        ratios.update({
            f"gguf_{key}_image_psnr_db": run["engine"]["image_psnr_db"],
            f"gguf_{key}_latents_psnr_db": run["latents_psnr_db"],
            f"gguf_{key}_memory_ratio": ratio(out[f"weights_gib_{key}"],
                                              out["weights_gib_bf16"]),
            f"gguf_{key}_linears_memory_ratio": ratio(out[f"linears_gib_{key}"],
                                                      out["linears_gib_bf16"]),
            f"gguf_{key}_speedup_vs_bf16": ratio(out["bf16_s"], run["seconds"]),
            f"gguf_{key}_speedup_vs_diffusers": ratio(reference.get("diffusers_s"), best_s),
            f"gguf_{key}_speedup_vs_diffusers_compiled": ratio(
                reference.get("diffusers_compiled_s"), best_s)})
    return ratios
