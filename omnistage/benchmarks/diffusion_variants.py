"""One diffusion transformer at its real shape (random weights, bf16), every way we and
diffusers can run it, in the same flow-match Euler loop: `omnistage bench diffusion --model
flux1-dev | z-image-turbo`, and `--model qwen-image --kernel-profile` (issue 23).

    variants   diffusers eager; diffusers with compile_repeated_blocks(fullgraph=True), as its
               docs advise; ours without the fused DiT kernels (the path before issue 23); ours
               (fused kernels); ours compiled (compile_blocks: a stage's default on CUDA); ours
               with FP8 linears, eager and compiled
    figures    seconds per image; final-latent PSNR of each bf16 variant against diffusers
               eager, of the FP8 ones against our bf16; peak memory during the loop; weight
               bytes in bf16 and FP8
    profile    the device time of one forward of each variant by kernel kind (torch.profiler:
               matmul, FP8 matmul, attention, norm / modulation, rotary, ...), the linears'
               FLOPs of a forward and the rate the matmuls reached, the top kernels by name
    start      (--start-times) the compile's cold and warm start: a fresh process builds our
               transformer, compiles its blocks and runs a forward, twice over one empty
               inductor cache folder (utils/compile_cache.py's role in a stage)

The headline ratios carry issue 23's names: exact_speedup_vs_diffusers_compiled (diffusers
compiled over our fastest bf16 variant), fp8_speedup_vs_diffusers_compiled (over our fastest
FP8 one), fp8_latents_psnr_db (this bench has no VAE: latents, not images).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import Tensor, nn

from omnistage.benchmarks.common import (default_dtype, environment, free_device_memory, ratio,
                                         seeded_init)
from omnistage.benchmarks.diffusion import QWEN_IMAGE, _denoise, psnr
from omnistage.benchmarks.diffusion import SCHEDULER as QWEN_SCHEDULER
from omnistage.benchmarks.diffusion import TINY as QWEN_TINY
from omnistage.benchmarks.kernel_profile import Forward, kernel_profile, linear_flops
from omnistage.utils.device import resolve_device

FLUX1_DEV = dict(in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                 guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FLUX_TINY = dict(in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12,
                 guidance_embeds=True, axes_dims_rope=(4, 6, 6))
Z_IMAGE_TURBO: dict[str, object] = {}          # diffusers' ZImageTransformer2DModel defaults
Z_TINY = dict(dim=48, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=24,
              axes_dims=[8, 8, 8], axes_lens=[128, 32, 32])
# (architecture, its tiny form, steps, caption tokens, scheduler_config.json of the model)
MODELS = {
    "qwen-image": (QWEN_IMAGE, QWEN_TINY, 20, 64, QWEN_SCHEDULER),
    "flux1-dev": (FLUX1_DEV, FLUX_TINY, 28, 512,
                  dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                       max_shift=1.15, num_train_timesteps=1000, shift=3.0,
                       use_dynamic_shifting=True)),
    "z-image-turbo": (Z_IMAGE_TURBO, Z_TINY, 8, 128,
                      dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)),
}

@dataclass(frozen=True, slots=True)
class VariantsConfig:
    model: str = "flux1-dev"              # flux1-dev | z-image-turbo | qwen-image
    tiny: bool = False
    size: int | None = None               # pixels, square (None: 1024; tiny 64)
    steps: int | None = None              # None: the model's usual count
    text_len: int | None = None
    fp8: bool = True
    compile: bool = True
    start_times: bool = False
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}: choose one of {sorted(MODELS)}")
        if self.pixels <= 0 or self.pixels % 16:
            raise ValueError(f"size={self.size}: must be a positive multiple of 16")
        if self.steps is not None and self.steps < 2:
            raise ValueError(f"steps={self.steps}: must be >= 2")

    @property
    def pixels(self) -> int:
        return self.size or (64 if self.tiny else 1024)

    @property
    def arch(self) -> dict[str, object]:
        return dict(MODELS[self.model][1 if self.tiny else 0])

    @property
    def num_steps(self) -> int:
        return self.steps or (3 if self.tiny else MODELS[self.model][2])

    @property
    def caption_tokens(self) -> int:
        return self.text_len or (8 if self.tiny else MODELS[self.model][3])


# ---- the models and how each is called -----------------------------------------------------

@dataclass
class Case:
    """One model's pieces: the diffusers class, our model from its config, the loop's latents
    and schedule, and how to call each (x, t in [0, 1]) -> velocity of x's shape."""

    reference_class: type
    ours: Callable[[dict], nn.Module]
    latents: Tensor
    sigmas: Tensor
    call_reference: Callable[[nn.Module], Forward]
    call_ours: Callable[[nn.Module], Forward]


def _sigmas(cfg: VariantsConfig, tokens: int) -> Tensor:
    from omnistage.diffusion.solvers import flow_match_euler as solver

    sched = solver.FlowMatchEulerConfig.from_dict(MODELS[cfg.model][4])
    mu = (solver.calculate_shift(tokens, sched.base_image_seq_len, sched.max_image_seq_len,
                                 sched.base_shift, sched.max_shift)
          if sched.use_dynamic_shifting else None)
    n = cfg.num_steps
    return solver.make_sigmas(sched, n, mu=mu, sigmas=np.linspace(1.0, 1 / n, n))[0]


def _case(cfg: VariantsConfig, device: torch.device, dtype: torch.dtype) -> Case:
    import diffusers

    arch, grid = cfg.arch, cfg.pixels // 16
    gen = torch.Generator().manual_seed(cfg.seed)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    if cfg.model == "qwen-image":
        from omnistage.models.qwen_image_transformer import (QwenImageTransformer2DModel,
                                                             QwenImageTransformerConfig)

        text = rand(1, cfg.caption_tokens, int(arch["joint_attention_dim"]))
        shapes = [[(1, grid, grid)]]
        return Case(diffusers.QwenImageTransformer2DModel,
                    lambda c: QwenImageTransformer2DModel(QwenImageTransformerConfig.from_dict(c)),
                    rand(1, grid * grid, int(arch["in_channels"])), _sigmas(cfg, grid * grid),
                    lambda m: lambda x, t: m(hidden_states=x, encoder_hidden_states=text,
                                             encoder_hidden_states_mask=None, timestep=t,
                                             img_shapes=shapes, return_dict=False)[0],
                    lambda m: lambda x, t: m(x, text, None, t, img_shapes=shapes))
    if cfg.model == "flux1-dev":
        from omnistage.diffusion.pipelines.flux import latent_image_ids
        from omnistage.models.flux_transformer import (FluxTransformer2DModel,
                                                       FluxTransformerConfig)

        text = rand(1, cfg.caption_tokens, int(arch["joint_attention_dim"]))
        pooled = rand(1, int(arch["pooled_projection_dim"]))
        img_ids = latent_image_ids(grid, grid).to(device, dtype)
        txt_ids = torch.zeros(cfg.caption_tokens, 3, device=device, dtype=dtype)
        guidance = torch.full((1,), 3.5, device=device)
        return Case(diffusers.FluxTransformer2DModel,
                    lambda c: FluxTransformer2DModel(FluxTransformerConfig.from_dict(c)),
                    rand(1, grid * grid, int(arch["in_channels"])), _sigmas(cfg, grid * grid),
                    lambda m: lambda x, t: m(hidden_states=x, encoder_hidden_states=text,
                                             pooled_projections=pooled, timestep=t,
                                             img_ids=img_ids, txt_ids=txt_ids,
                                             guidance=guidance, return_dict=False)[0],
                    lambda m: lambda x, t: m(x, text, pooled, t, img_ids, txt_ids, guidance))
    from omnistage.models.z_image_transformer import ZImageConfig, ZImageTransformer2DModel

    caption = rand(cfg.caption_tokens, int(arch.get("cap_feat_dim", 2560)))
    channels = int(arch.get("in_channels", 16))
    return Case(diffusers.ZImageTransformer2DModel,
                lambda c: ZImageTransformer2DModel(ZImageConfig.from_dict(c)),
                rand(1, channels, 1, 2 * grid, 2 * grid), _sigmas(cfg, grid * grid),
                lambda m: lambda x, t: torch.stack(m(list(x), 1 - t, [caption],
                                                     return_dict=False)[0]),
                lambda m: lambda x, t: torch.stack(m(list(x), 1 - t, [caption])))


# ---- measuring -------------------------------------------------------------------------------

@contextmanager
def _fused(enabled: bool) -> Iterator[None]:
    from omnistage.layers import fused

    before = fused.is_enabled()
    fused.set_enabled(enabled)
    try:
        yield
    finally:
        fused.set_enabled(before)


def _timed(forward: Forward, case: Case, device: torch.device) -> tuple[Tensor, float, float]:
    """The loop after a 2-step warm-up (which compiles): final latents, seconds, peak GiB."""
    with torch.inference_mode():
        _denoise(forward, case.latents, case.sigmas[:3], device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        final, seconds = _denoise(forward, case.latents, case.sigmas, device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return final, seconds, peak


def _variant(name: str, forward: Forward, case: Case, device: torch.device,
             against: Tensor | None, flops: int | None, profile: bool
             ) -> tuple[dict[str, object], Tensor]:
    """One variant's loop (and profile); `against`: the latents its PSNR is taken to (None:
    it is the baseline)."""
    t0 = time.perf_counter()
    final, seconds, peak = _timed(forward, case, device)
    db = None if against is None else psnr(final.float(), against.float())
    out = {"seconds": seconds, "first_call_and_warmup_s": time.perf_counter() - t0 - seconds,
           "peak_gib": peak, "latents_psnr_db": db}
    if profile:
        t = case.sigmas[:1].to(device, case.latents.dtype)
        out["profile"] = kernel_profile(forward, case.latents, t, flops)
    print(f"{name}: {seconds:.3f} s" + ("" if db is None else f", {db:.1f} dB"), flush=True)
    return out, final


def _uncompile(model: nn.Module) -> None:
    from omnistage.diffusion.pipeline import uncompile_blocks

    uncompile_blocks(model)
    torch._dynamo.reset()           # its compiled code must not keep the weights alive


def _reference_variants(cfg: VariantsConfig, case: Case, device: torch.device,
                        dtype: torch.dtype, profile: bool
                        ) -> tuple[dict[str, dict], Tensor, dict[str, tuple]]:
    with torch.device(device), default_dtype(dtype):
        ref = case.reference_class(**cfg.arch).eval()
    seeded_init(ref, cfg.seed)
    forward = case.call_reference(ref)
    runs: dict[str, dict] = {}
    runs["diffusers"], base = _variant("diffusers", forward, case, device, None, None, profile)
    if cfg.compile:
        ref.compile_repeated_blocks(fullgraph=True)
        runs["diffusers_compiled"], _ = _variant("diffusers_compiled", forward, case, device,
                                                 base, None, profile)
        torch._dynamo.reset()
    config = dict(ref.config)
    names = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    del ref, forward
    free_device_memory(device)
    return runs, base, {"config": config, "names": names}


def _our_variants(cfg: VariantsConfig, case: Case, device: torch.device, dtype: torch.dtype,
                  base: Tensor, ref: dict, profile: bool) -> dict[str, dict]:
    from omnistage.diffusion.pipeline import compile_blocks
    from omnistage.layers.fp8 import MIN_FEATURES, quantize_fp8
    from omnistage.layers.graph_capture import ShapeGraphs

    with torch.device(device), default_dtype(dtype):
        ours = case.ours({k: v for k, v in ref["config"].items() if not k.startswith("_")})
        ours = ours.eval()
    mine = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    if mine != ref["names"]:
        raise RuntimeError(f"parameter names differ from diffusers': "
                           f"{sorted(set(mine.items()) ^ set(ref['names'].items()))[:6]}")
    seeded_init(ours, cfg.seed)
    forward = case.call_ours(ours)
    t = case.sigmas[:1].to(device, dtype)
    flops = linear_flops(ours, forward, case.latents, t)
    runs: dict[str, dict] = {}
    with _fused(False):
        runs["ours_unfused"], _ = _variant("ours_unfused", forward, case, device, base, flops,
                                           profile)
    runs["ours"], bf16 = _variant("ours", forward, case, device, base, flops, profile)

    def variants(prefix: str, against: Tensor) -> None:
        """The model as it is now, from CUDA graphs (a stage's default), then compiled, with
        and without graphs."""
        for suffix, compiled, graphs in (("_graphs", False, True), ("_compiled", True, False),
                                         ("_compiled_graphs", True, True)):
            if (graphs and device.type != "cuda") or (compiled and not cfg.compile):
                continue
            if compiled:
                compile_blocks(ours)
            name = prefix + suffix
            runs[name], _ = _variant(name, ShapeGraphs(forward) if graphs else forward, case,
                                     device, against, flops, profile)
            if compiled:
                _uncompile(ours)

    variants("ours", base)
    if cfg.fp8 and (device.type == "cuda" or cfg.tiny):
        weights = _weight_gib(ours)
        quantize_fp8(ours, min_features=16 if cfg.tiny else MIN_FEATURES, allow_cpu=cfg.tiny)
        free_device_memory(device)
        runs["ours_fp8"], _ = _variant("ours_fp8", forward, case, device, bf16, flops, profile)
        variants("ours_fp8", bf16)
        runs["ours_fp8"]["weights_gib"] = {"bf16": weights, "fp8": _weight_gib(ours)}
    runs["ours"]["linear_tflop_per_forward"] = flops / 1e12
    return runs                                      # the model is freed with this frame


def _weight_gib(model: nn.Module) -> float:
    return sum(t.numel() * t.element_size()
               for t in (*model.parameters(), *model.buffers())) / 2**30


# ---- the compile's cold and warm start -------------------------------------------------------

def start_once(cfg: VariantsConfig) -> dict[str, float]:
    """In this (fresh) process: build our transformer, compile its blocks, time the first
    forward (which compiles, or loads from the cache) and the second."""
    from omnistage.diffusion.pipeline import compile_blocks

    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    case = _case(cfg, device, dtype)
    with torch.device("meta"):                      # only its config: diffusers' defaults filled
        ref_config = dict(case.reference_class(**cfg.arch).config)
    with torch.device(device), default_dtype(dtype):
        ours = case.ours({k: v for k, v in ref_config.items() if not k.startswith("_")}).eval()
    seeded_init(ours, cfg.seed)
    compile_blocks(ours)
    forward = case.call_ours(ours)
    t = case.sigmas[:1].to(device, dtype)
    times = []
    with torch.inference_mode():
        for _ in range(2):
            t0 = time.perf_counter()
            forward(case.latents, t)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return {"first_forward_s": times[0], "second_forward_s": times[1]}


def start_times(cfg: VariantsConfig) -> dict[str, object]:
    """start_once in two fresh processes over one empty inductor cache: cold, then warm."""
    runs = {}
    with tempfile.TemporaryDirectory(prefix="omnistage-inductor-") as folder:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": folder,
               "TRITON_CACHE_DIR": os.path.join(folder, "triton")}
        for name in ("cold", "warm"):
            done = subprocess.run(
                [sys.executable, "-m", "omnistage.benchmarks.diffusion_variants",
                 json.dumps(asdict(cfg))], env=env, capture_output=True, text=True,
                timeout=1200, check=False)
            if done.returncode:
                raise RuntimeError(f"{name} start failed:\n{done.stderr[-3000:]}")
            runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    runs["compile_saved_s"] = runs["cold"]["first_forward_s"] - runs["warm"]["first_forward_s"]
    return runs


# ---- the run ---------------------------------------------------------------------------------

def headline(runs: dict[str, dict]) -> dict[str, float | None]:
    def best(*names: str) -> float | None:
        times = [runs[n]["seconds"] for n in names if n in runs]
        return min(times) if times else None

    ref, ref_c = runs["diffusers"]["seconds"], runs.get("diffusers_compiled", {}).get("seconds")
    exact = best(*(n for n in runs if n.startswith("ours") and "fp8" not in n))
    fp8 = best(*(n for n in runs if n.startswith("ours_fp8")))
    fp8_psnr = [v["latents_psnr_db"] for n, v in runs.items() if n.startswith("ours_fp8")]
    return {"speedup_vs_diffusers": ratio(ref, runs["ours"]["seconds"]),
            "fused_kernels_speedup": ratio(runs["ours_unfused"]["seconds"],
                                           runs["ours"]["seconds"]),
            "exact_speedup_vs_diffusers_compiled": ratio(ref_c, exact),
            "exact_fastest": min((n for n in runs if n.startswith("ours") and "fp8" not in n),
                                 key=lambda n: runs[n]["seconds"]),
            "fp8_speedup_vs_diffusers_compiled": ratio(ref_c, fp8),
            "fp8_latents_psnr_db": min(fp8_psnr) if fp8_psnr else None}


def run(cfg: VariantsConfig, profile: bool = True) -> dict[str, object]:
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    case = _case(cfg, device, dtype)
    runs, base, ref = _reference_variants(cfg, case, device, dtype, profile)
    runs.update(_our_variants(cfg, case, device, dtype, base, ref, profile))
    free_device_memory(device)                       # before start_times' processes
    result = {"benchmark": "diffusion_variants", "model": cfg.model, **environment(device),
              "dtype": str(dtype).removeprefix("torch."),
              "config": {**asdict(cfg), "arch": cfg.arch, "steps": cfg.num_steps,
                         "text_len": cfg.caption_tokens},
              "variants": runs, "ratios": headline(runs),
              "notes": "seconds: the whole Euler loop of one image (batch 1, no CFG) after a "
                       "2-step warm-up. latents_psnr_db: bf16 variants against diffusers "
                       "eager, FP8 ones against our bf16. profile: one forward's device time "
                       "by kernel kind; matmul_tflops: the linears' FLOPs over the matmul "
                       "kernels' time."}
    if cfg.start_times:
        result["start"] = start_times(cfg)
    return result


if __name__ == "__main__":       # start_times' child: one fresh process's compile start
    print(json.dumps(start_once(VariantsConfig(**json.loads(sys.argv[1])))))
