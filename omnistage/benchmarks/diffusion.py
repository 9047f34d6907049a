"""Qwen-Image's transformer, ours against diffusers' on the same random weights, and our
diffusion engine's step caching and step-level batching on it.

    1. transformer:  the same 20-step flow-match Euler loop (Qwen-Image's schedule for the
                     image size) around diffusers' QwenImageTransformer2DModel, then around
                     ours: seconds per image, and how far apart their final latents are (bf16)
    2. engine:       DiffusionEngine + QwenImagePipeline with our transformer, a small random
                     VAE and no text encoder: each request gets its caption states directly
                     (`set_conditioning`, as a split graph's encoder stage would send them), so
                     text encoding is not what is measured. One image alone; with step caching
                     at each threshold (speed-up, steps skipped, PSNR of the latents and of the
                     decoded image against the uncached run); `concurrency` requests one at a
                     time against all at once (step-level batching: one forward per step for
                     every request)

Weights: `seeded_init` draws every tensor from a generator seeded by its name, on the device,
so diffusers' model and ours (same parameter names) get identical weights without both being
in memory at once (the real size is 20B parameters, 41 GB in bf16). Each model is built in
bf16 directly on the device. No CFG (one branch per image); captions of `text_len` tokens.
The real VAE is not used (a small one with the same latent layout: its decode is not measured
against anything).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Protocol

import numpy as np
import torch
from torch import Tensor

from omnistage.benchmarks.common import (default_dtype, environment, free_device_memory, now,
                                         ratio, seeded_init)
from omnistage.utils.device import resolve_device

# diffusers' QwenImageTransformer2DModel defaults = Qwen/Qwen-Image's transformer config
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60,
                  attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                  axes_dims_rope=(16, 56, 56))
TINY = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4))
CACHE_THRESHOLDS = (0.1, 0.2, 0.4, 0.8)
# Qwen/Qwen-Image's scheduler_config.json
SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
                 num_train_timesteps=1000, shift=1.0, shift_terminal=0.02,
                 use_dynamic_shifting=True, time_shift_type="exponential")


@dataclass(frozen=True, slots=True)
class DiffusionBenchConfig:
    sizes: str = "qwen-image"             # qwen-image | tiny
    size: int = 1024                      # pixels, square
    steps: int = 20
    num_layers: int = 60
    text_len: int = 64
    cache_thresholds: tuple[float, ...] = CACHE_THRESHOLDS
    concurrency: int = 4
    vae_base_dim: int = 16
    compile: bool = False                 # also time our transformer with compile_blocks
    # fp8 / int8: also our transformer with 8-bit linears (benchmarks/diffusion_fp8.py);
    # COMPONENT=METHOD,...: transformer fp8 / int8 and attention fp8 (`split_quantization`);
    # gguf: its linears as GGUF Q8_0 and Q4_0 blocks (benchmarks/diffusion_gguf.py)
    quantization: str | None = None
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sizes not in ("qwen-image", "tiny"):
            raise ValueError(f"sizes={self.sizes!r}: choose qwen-image or tiny")
        if self.size <= 0 or self.size % 16:
            raise ValueError(f"size={self.size}: must be a positive multiple of 16")
        if self.steps < 2:
            raise ValueError(f"steps={self.steps}: must be >= 2")
        if self.num_layers < 1 or self.text_len < 1 or self.concurrency < 1:
            raise ValueError("num_layers, text_len and concurrency must be >= 1")
        if self.quantization is not None:
            split_quantization(self.quantization)

    @property
    def reference_compiled(self) -> bool:
        """Whether diffusers' regional compilation is timed too: for any variant that claims
        a speed-up over it (compiled, FP8)."""
        return self.compile or self.quantization is not None

    @classmethod
    def preset(cls, sizes: str, *, size: int | None = None, steps: int | None = None,
               num_layers: int | None = None, cache_thresholds: tuple[float, ...] | None = None,
               **kw: object) -> DiffusionBenchConfig:
        tiny = sizes == "tiny"
        return cls(sizes=sizes, size=size or (64 if tiny else 1024), steps=steps or (4 if tiny
                   else 20), num_layers=num_layers or (2 if tiny else 60),
                   cache_thresholds=cache_thresholds or ((0.2, 0.5) if tiny
                                                         else CACHE_THRESHOLDS),
                   vae_base_dim=8 if tiny else 16, **kw)

    @property
    def transformer(self) -> dict[str, object]:
        return {**(TINY if self.sizes == "tiny" else QWEN_IMAGE), "num_layers": self.num_layers}


def split_quantization(spec: str) -> tuple[str | None, str | None]:
    """`--quantization` -> (the linears' method: fp8, int8, gguf or None; the attention's: fp8
    or None) from `fp8`, `int8` or `transformer=fp8|int8`, `attention=fp8` joined by commas,
    or `gguf` / `transformer=gguf` alone (no file: the bench quantizes its own weights)."""
    from omnistage.configs.quantization import Quantization

    if spec.replace(" ", "") in ("gguf", "transformer=gguf"):
        return "gguf", None
    message = (f"quantization={spec!r}: fp8, int8, gguf, or transformer=fp8|int8 and/or "
               "attention=fp8 (comma-separated)")
    try:
        items = Quantization.parse(spec).items()
    except ValueError:
        raise ValueError(message) from None
    linears, attention = items.pop("transformer", None), items.pop("attention", None)
    if items or not (linears or attention) or (linears and linears.method not in ("fp8",
                                                                                   "int8")):
        raise ValueError(message)
    return (linears.method if linears else None), ("fp8" if attention else None)


def psnr(x: Tensor, ref: Tensor, peak: float | None = None) -> float:
    """10 log10(peak^2 / MSE); peak None: the reference's range (for latents)."""
    x, ref = x.double(), ref.double()
    mse = float((x - ref).pow(2).mean())
    peak = float(ref.max() - ref.min()) if peak is None else peak
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def _schedule(cfg: DiffusionBenchConfig) -> Tensor:
    from omnistage.diffusion.solvers import flow_match_euler as solver

    sched = solver.FlowMatchEulerConfig.from_dict(SCHEDULER)
    tokens = (cfg.size // 16) ** 2
    mu = solver.calculate_shift(tokens, sched.base_image_seq_len, sched.max_image_seq_len,
                                sched.base_shift, sched.max_shift)
    sigmas, _ = solver.make_sigmas(sched, cfg.steps, mu=mu,
                                   sigmas=np.linspace(1.0, 1 / cfg.steps, cfg.steps))
    return sigmas                                                            # (steps + 1,)


# ---- 1. transformer against transformer ---------------------------------------------------

def _denoise(forward: Callable[[Tensor, Tensor], Tensor], latents: Tensor, sigmas: Tensor,
             device: torch.device) -> tuple[Tensor, float]:
    """The Euler loop both transformers run in: -> final latents, seconds (synchronized)."""
    from omnistage.diffusion.solvers import flow_match_euler as solver

    sigmas = sigmas.to(device)
    x = latents.clone()
    t0 = now(device)
    for i in range(len(sigmas) - 1):
        timestep = (sigmas[i] * 1000).to(x.dtype).expand(x.shape[0]) / 1000
        x = solver.step(forward(x, timestep), x, sigmas, i).to(latents.dtype)
    return x, now(device) - t0


Timed = Callable[[Callable[[Tensor, Tensor], Tensor]], tuple[Tensor, float]]


def denoiser_inputs(cfg: DiffusionBenchConfig, device: torch.device, dtype: torch.dtype
                    ) -> tuple[Tensor, Tensor, Timed]:
    """The run's latents and caption states (the same for every variant, from cfg.seed), and
    `timed(forward)`: the whole Euler loop after a 2-step warm-up -> final latents, seconds."""
    arch = cfg.transformer
    grid = cfg.size // 16
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    latents = torch.randn(1, grid * grid, int(arch["in_channels"]), generator=gen).to(device,
                                                                                      dtype)
    text = torch.randn(1, cfg.text_len, int(arch["joint_attention_dim"]), generator=gen
                       ).to(device, dtype)
    sigmas = _schedule(cfg)

    def timed(forward: Callable[[Tensor, Tensor], Tensor]) -> tuple[Tensor, float]:
        with torch.inference_mode():
            _denoise(forward, latents, sigmas[:3], device)                  # warm-up
            return _denoise(forward, latents, sigmas, device)

    return latents, text, timed


def bench_transformers(cfg: DiffusionBenchConfig, device: torch.device, dtype: torch.dtype
                       ) -> tuple[dict[str, object], torch.nn.Module, Tensor]:
    """-> timings and latent agreement, our transformer (kept for the engine), the caption
    states (text_len, joint) both ran with."""
    import diffusers

    from omnistage.models.qwen_image_transformer import (QwenImageTransformer2DModel,
                                                         QwenImageTransformerConfig)

    arch = cfg.transformer
    grid = cfg.size // 16
    _, text, timed = denoiser_inputs(cfg, device, dtype)
    img_shapes = [[(1, grid, grid)]]
    out: dict[str, object] = {}
    final: dict[str, Tensor] = {}

    # diffusers first, then freed: the real size does not fit twice on an 80 GB card
    with torch.device(device), default_dtype(dtype):
        ref = diffusers.QwenImageTransformer2DModel(**arch).eval()
    num_params = seeded_init(ref, cfg.seed)

    def reference(x: Tensor, t: Tensor) -> Tensor:
        return ref(hidden_states=x, encoder_hidden_states=text, encoder_hidden_states_mask=None,
                   timestep=t, img_shapes=img_shapes, return_dict=False)[0]

    final["diffusers"], out["diffusers_s"] = timed(reference)
    if cfg.reference_compiled:      # diffusers' own regional compilation, as its docs advise
        ref.compile_repeated_blocks(fullgraph=True)
        _, out["diffusers_compiled_s"] = timed(reference)
        torch._dynamo.reset()       # its compiled code must not keep the weights alive
    names = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    ref = None
    free_device_memory(device)

    with torch.device(device), default_dtype(dtype):
        ours = QwenImageTransformer2DModel(QwenImageTransformerConfig.from_dict(arch)).eval()
    mine = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    if mine != names:
        raise RuntimeError(f"parameter names differ from diffusers': "
                           f"{sorted(set(mine.items()) ^ set(names.items()))[:6]}")
    seeded_init(ours, cfg.seed)
    final["omnistage"], out["omnistage_s"] = timed(
        lambda x, t: ours(x, text, None, t, img_shapes=img_shapes))
    if cfg.compile:
        out.update(_compiled(ours, timed, lambda x, t: ours(x, text, None, t,
                                                           img_shapes=img_shapes),
                             final["omnistage"], out["omnistage_s"]))
    a, b = final["omnistage"].float(), final["diffusers"].float()
    out.update(num_parameters=num_params,
               latents_rel_diff=float((a - b).norm() / b.norm()),
               latents_psnr_db=psnr(a, b), speedup=ratio(out["diffusers_s"], out["omnistage_s"]))
    return out, ours, text[0]


def _compiled(model: torch.nn.Module, timed, forward, eager_final: Tensor, eager_s: float
              ) -> dict[str, object]:
    """The same denoising with the blocks compiled (`compile_blocks`, as a stage's
    `diffusion: {compile: true}`), then the eager blocks put back: seconds, the first call's
    compile time, speed-up and PSNR against the eager run."""
    from omnistage.diffusion.pipeline import compile_blocks, uncompile_blocks

    t0 = time.perf_counter()
    compile_blocks(model)
    final, seconds = timed(forward)          # its warm-up compiles
    total = time.perf_counter() - t0
    uncompile_blocks(model)
    return {"compiled_s": seconds, "compile_and_warmup_s": total - seconds,
            "compiled_speedup_vs_eager": ratio(eager_s, seconds),
            "compiled_latents_psnr_db": psnr(final.float(), eager_final.float())}


# ---- 2. the engine ------------------------------------------------------------------------

def _pipeline(transformer, cfg: DiffusionBenchConfig, device: torch.device,
              dtype: torch.dtype):
    from omnistage.diffusion.pipelines.qwen_image import QwenImagePipeline
    from omnistage.diffusion.solvers.flow_match_euler import FlowMatchEulerConfig
    from omnistage.models.autoencoder_kl_qwen_image import AutoencoderKLQwenImage
    from omnistage.models.autoencoder_kl_wan import AutoencoderKLWanConfig

    z = int(cfg.transformer["in_channels"]) // 4
    vae_cfg = AutoencoderKLWanConfig(base_dim=cfg.vae_base_dim, z_dim=z, num_res_blocks=1,
                                     latents_mean=(0.0,) * z, latents_std=(1.0,) * z)
    with torch.device(device), default_dtype(dtype):
        vae = AutoencoderKLQwenImage(vae_cfg).eval()
    seeded_init(vae, cfg.seed + 1)
    return QwenImagePipeline(transformer, vae, None, FlowMatchEulerConfig.from_dict(SCHEDULER),
                             device)


def _serve(engine, pipe, requests: list[tuple[str, object]], text: Tensor,
           device: torch.device) -> tuple[float, dict[str, Tensor], dict[str, Tensor],
                                          dict[str, dict]]:
    """Add every request, run the engine dry: -> seconds, final latents, images, metrics."""
    latents: dict[str, Tensor] = {}
    decode = pipe.decode
    seed_to_id = {p.seed: rid for rid, p in requests}

    def spy(x: Tensor, params) -> Tensor:                 # the latents the engine finished
        latents[seed_to_id[params.seed]] = x.float().cpu()
        return decode(x, params)

    pipe.decode = spy
    try:
        t0 = now(device)
        for rid, params in requests:
            engine.add_request(rid, None, params)
            engine.set_conditioning(rid, {"prompt_embeds": text})
        images, metrics = {}, {}
        while engine.has_unfinished_requests:
            for r in engine.step():
                if r.finished:
                    if r.error:
                        raise RuntimeError(f"diffusion request {r.request_id}: {r.error}")
                    images[r.request_id], metrics[r.request_id] = r.images, r.metrics
        seconds = now(device) - t0
    finally:
        pipe.decode = decode
    return seconds, latents, images, metrics


class EngineRun(Protocol):
    """What the engine figures read of a run's config (Qwen-Image's or FLUX.2's)."""

    size: int
    steps: int
    cache_thresholds: tuple[float, ...]
    concurrency: int


def request_params(cfg: EngineRun, seed: int, threshold: float | None = None,
                   steps: int | None = None):
    """One engine request of the run's size: `steps` (default the run's), a step-cache
    `threshold` (None: uncached)."""
    from omnistage.diffusion.params import DiffusionParams

    return DiffusionParams(height=cfg.size, width=cfg.size, num_inference_steps=steps or cfg.steps,
                           seed=seed, cache_threshold=threshold)


def best_cached(cache: list[dict], key: str, min_db: float) -> dict | None:
    """The fastest step-cache entry whose PSNR `key` reaches `min_db` (None: none does)."""
    good = [c for c in cache if c[key] >= min_db]
    return max(good, key=lambda c: c["speedup"]) if good else None


def bench_engine(transformer, text: Tensor, cfg: DiffusionBenchConfig, device: torch.device,
                 dtype: torch.dtype) -> tuple[dict[str, object], Tensor]:
    """-> the engine's figures, and the uncached image (the reference of other variants)."""
    return engine_figures(_pipeline(transformer, cfg, device, dtype), text, cfg, device)


def engine_figures(pipe, text: Tensor, cfg: EngineRun, device: torch.device
                   ) -> tuple[dict[str, object], Tensor]:
    """A pipeline without text encoders in the engine, every request given `text` as its
    prompt_embeds: one image alone, step-cached at each threshold, `concurrency` requests one
    at a time against all at once. -> the figures, and the uncached image."""
    from omnistage.diffusion.engine import DiffusionEngine

    engine = DiffusionEngine(pipe, max_num_seqs=cfg.concurrency)

    def params(seed: int, threshold: float | None = None, steps: int | None = None):
        return request_params(cfg, seed, threshold, steps)

    _serve(engine, pipe, [("warm", params(10_000, None, 2))], text, device)
    base_s, base_latents, base_images, _ = _serve(engine, pipe, [("base", params(0))], text,
                                                  device)
    cache = []
    for thr in cfg.cache_thresholds:
        s, lat, img, met = _serve(engine, pipe, [("cached", params(0, thr))], text, device)
        cache.append({"threshold": thr, "seconds": s, "speedup": ratio(base_s, s),
                      "steps_skipped": met["cached"].num_steps_skipped,
                      "latents_psnr_db": psnr(lat["cached"], base_latents["base"]),
                      "image_psnr_db": psnr(img["cached"].float(),
                                            base_images["base"].float(), 255.0)})
    best = best_cached(cache, "latents_psnr_db", 30.0)

    n = cfg.concurrency
    one_by_one = sum(_serve(engine, pipe, [(f"seq{i}", params(100 + i))], text, device)[0]
                     for i in range(n))
    batched, *_ = _serve(engine, pipe, [(f"bat{i}", params(100 + i)) for i in range(n)], text,
                         device)
    return {"seconds_per_image": base_s, "step_cache": cache,
            "step_cache_best_at_30db": best,
            "batching": {"concurrency": n, "one_at_a_time_s": one_by_one,
                         "batched_s": batched,
                         "images_per_s_one_at_a_time": n / one_by_one,
                         "images_per_s_batched": n / batched,
                         "speedup": ratio(one_by_one, batched)}}, base_images["base"]


# ---- the run ------------------------------------------------------------------------------

# the FP8 part of a run (diffusion_fp8.bench_fp8), passed in by the caller: that module builds
# on this one, so this one does not import it
Fp8Bench = Callable[..., dict]


def run(cfg: DiffusionBenchConfig, fp8: Fp8Bench | None = None) -> dict[str, object]:
    """The whole benchmark; with `cfg.quantization`, `fp8` (diffusion_fp8.bench_fp8) adds
    our transformer with FP8 linears."""
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    transformer_result, ours, text = bench_transformers(cfg, device, dtype)
    engine_result, image = bench_engine(ours, text, cfg, device, dtype)
    fp8_result = None
    if cfg.quantization:
        assert fp8 is not None, "quantization asked without the fp8 bench (diffusion_fp8)"
        fp8_result = fp8(ours, image, transformer_result, cfg, device, dtype)
    del ours
    free_device_memory(device)
    best = engine_result["step_cache_best_at_30db"]
    ratios = {"transformer_speedup_vs_diffusers": transformer_result["speedup"],
              "engine_seconds_per_image_vs_diffusers": ratio(
                  transformer_result["diffusers_s"], engine_result["seconds_per_image"]),
              "step_cache_speedup_at_30db": best["speedup"] if best else None,
              "step_cache_psnr_db": best["latents_psnr_db"] if best else None,
              "step_cache_speedup_vs_diffusers": ratio(transformer_result["diffusers_s"],
                                                       best["seconds"]) if best else None,
              "batching_speedup": engine_result["batching"]["speedup"]}
    if cfg.compile:
        ratios["compiled_speedup_vs_diffusers"] = ratio(transformer_result["diffusers_s"],
                                                        transformer_result["compiled_s"])
    if cfg.reference_compiled:
        ratios["exact_speedup_vs_diffusers_compiled"] = ratio(
            transformer_result["diffusers_compiled_s"],
            transformer_result.get("compiled_s", transformer_result["omnistage_s"]))
    if fp8_result:
        ratios.update(fp8_result.pop("ratios"))
    return {
        "benchmark": "diffusion", **environment(device),
        "dtype": str(dtype).removeprefix("torch."),
        "config": {**asdict(cfg), "transformer": cfg.transformer, "scheduler": SCHEDULER},
        "transformer": transformer_result, "engine": engine_result,
        **({split_quantization(cfg.quantization)[0] or "fp8": fp8_result} if fp8_result
           else {}), "ratios": ratios,
        "notes": "speedups: reference seconds over ours (above 1: ours is faster). PSNR of the "
                 "step-cached run against the uncached one: latents with the reference's range "
                 "as peak, images (small random VAE) with 255. Random weights: how many steps a "
                 "threshold skips is not what it would skip on the trained model.",
    }
