"""Wan transformers at real shapes, ours against diffusers' `WanTransformer3DModel` on the same
random weights (bf16): the time of one step of the denoising loop with classifier-free
guidance (two branches a step, as both pipelines run it).

    5b    Wan2.2-TI2V-5B's transformer (dim 3072, 30 layers, 24 heads, 48 latent channels;
          16x VAE): 704x1280, 121 frames = 31 x 22 x 40 = 27,280 tokens a branch
    14b   Wan2.1-T2V-14B's (dim 5120, 40 layers, 40 heads; 8x VAE): 832x480, 81 frames
          = 21 x 30 x 52 = 32,760 tokens a branch

Per model, one model on the device at a time (the 14B's 28 GB of weights fit once on 80 GB):

    1. diffusers eager     WanPipeline's loop: the conditional call, then the unconditional
                           one (TI2V-5B with a timestep per token, its `expand_timesteps`)
    2. diffusers compiled  the same model after `compile_repeated_blocks(fullgraph=True)`, its
                           regional compilation (the warm-up step compiles)
    3. ours                WanPipeline.velocity's layout: both branches in one call of two
                           rows, replayed from CUDA graphs as a stage does on a GPU; the whole
                           schedule of `steps` steps, each timed. With `compile_ours`, also
                           `timed_steps` steps with its blocks compiled (compile_blocks: a
                           stage's `compile: true`), after a warm-up step that compiles
    4. ours, step cached   the same schedule with step caching (a state per branch, as the
                           pipeline keeps them), watching the modulated input at each threshold
                           until one falls under 30 dB, and the 14B's published TeaCache
                           polynomial once (CACHE_THRESHOLDS says why): seconds per step, steps
                           skipped, the final latents' PSNR against 3's

The references time `timed_steps` steps after one warm-up step; every loop steps with our flow
UniPC (Wan's schedule and shift), starts from the same noise and the same text (random
embeddings of `text_len` tokens; no text encoder or VAE runs). Ours after the references'
number of steps is compared with diffusers eager's latents there (PSNR): the same model.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import Tensor

from omnistage.benchmarks.common import (default_dtype, environment, free_device_memory, now,
                                         ratio, seeded_init)
from omnistage.benchmarks.diffusion import psnr
from omnistage.utils.device import resolve_device

# diffusers configs of the published transformers (Wan-AI/Wan2.2-TI2V-5B-Diffusers,
# Wan-AI/Wan2.1-T2V-14B-Diffusers), the pixel size and frames benchmarked, the VAE's factors
# (spatial, temporal) and the scheduler's flow shift
COMMON = dict(patch_size=(1, 2, 2), attention_head_dim=128, text_dim=4096, freq_dim=256,
              cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
MODELS = {
    "5b": dict(arch={**COMMON, "num_attention_heads": 24, "in_channels": 48, "out_channels": 48,
                     "ffn_dim": 14336, "num_layers": 30},
               size=(704, 1280), frames=121, vae=(16, 4), shift=5.0, per_token_t=True),
    "14b": dict(arch={**COMMON, "num_attention_heads": 40, "in_channels": 16,
                      "out_channels": 16, "ffn_dim": 13824, "num_layers": 40},
                size=(480, 832), frames=81, vae=(8, 4), shift=3.0, per_token_t=False),
}
TINY = {name: dict(spec, arch={**spec["arch"], "num_attention_heads": 2,
                               "attention_head_dim": 12, "text_dim": 16, "freq_dim": 32,
                               "ffn_dim": 40, "num_layers": 2,
                               "in_channels": 8 if name == "5b" else 4,
                               "out_channels": 8 if name == "5b" else 4},
                   size=(64, 96) if name == "5b" else (32, 48), frames=5)
        for name, spec in MODELS.items()}
# Step caching watches the first block's modulated input as is (the 5B's indicator when
# served): on these random weights it moves by a relative 0.25-0.35 a step of an 8-step
# schedule (a CPU estimate on noised latents), so 0.3 skips 2 or 3 steps and 0.6 about 4;
# thresholds are tried in order until one falls under 30 dB. The 14B when served watches its timestep embedding through TeaCache's
# Wan2.1 T2V-14B polynomial (models/wan_transformer.py), tried once at TeaCache's 0.2: fitted
# on the trained model, it reads the random embedding's ~100% change a step as negative and
# skips every step it may.
CACHE_THRESHOLDS = (0.3, 0.6)
PUBLISHED_THRESHOLD = 0.2
GUIDANCE = 5.0                                      # WanPipeline's default


@dataclass(frozen=True, slots=True)
class VideoBenchConfig:
    sizes: str = "real"                   # real | tiny
    models: tuple[str, ...] = ("5b", "14b")
    steps: int = 8                        # ours' schedule (plain and cached)
    timed_steps: int = 2                  # the references', after one warm-up step
    text_len: int = 512
    cache_thresholds: tuple[float, ...] = CACHE_THRESHOLDS
    compile_backend: str = "inductor"     # diffusers' compile_repeated_blocks; "" skips it
    cuda_graphs: bool = True              # ours replayed from CUDA graphs (CUDA only)
    compile_ours: bool = False            # also ours with compile_blocks (a minute or two)
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sizes not in ("real", "tiny"):
            raise ValueError(f"sizes={self.sizes!r}: choose real or tiny")
        unknown = set(self.models) - set(MODELS)
        if unknown or not self.models:
            raise ValueError(f"models={self.models}: choose from {', '.join(MODELS)}")
        if self.timed_steps < 1 or self.steps < self.timed_steps + 1:
            raise ValueError(f"steps={self.steps}, timed_steps={self.timed_steps}: need "
                             "timed_steps >= 1 and steps > timed_steps")
        if self.text_len < 1:
            raise ValueError(f"text_len={self.text_len}: must be >= 1")

    @classmethod
    def preset(cls, sizes: str, *, steps: int | None = None, timed_steps: int | None = None,
               cache_thresholds: tuple[float, ...] | None = None, **kw: object
               ) -> VideoBenchConfig:
        tiny = sizes == "tiny"
        return cls(sizes=sizes, steps=steps or (3 if tiny else 8),
                   timed_steps=timed_steps or (1 if tiny else 2),
                   cache_thresholds=cache_thresholds or CACHE_THRESHOLDS,
                   text_len=8 if tiny else 512,
                   **{"compile_backend": "eager" if tiny else "inductor", **kw})

    def spec(self, model: str) -> dict:
        return (TINY if self.sizes == "tiny" else MODELS)[model]


def log(message: str) -> None:
    """Progress on stderr (the real run takes minutes)."""
    print(f"[bench video {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(slots=True)
class Inputs:
    """What every loop of one model starts from: noise (1, C, F', H', W') float32, the text
    and negative text (1, L, text_dim), the schedule."""
    latents: Tensor
    text: Tensor
    negative: Tensor
    sigmas: Tensor
    timesteps: Tensor
    solver: object

    @classmethod
    def make(cls, cfg: VideoBenchConfig, spec: dict, device: torch.device,
             dtype: torch.dtype) -> Inputs:
        from omnistage.diffusion.solvers.unipc_flow import FlowUniPC, UniPCConfig

        arch = spec["arch"]
        (height, width), (spatial, temporal) = spec["size"], spec["vae"]
        shape = (1, arch["in_channels"], 1 + (spec["frames"] - 1) // temporal,
                 height // spatial, width // spatial)
        gen = torch.Generator().manual_seed(cfg.seed)
        latents = torch.randn(shape, generator=gen).to(device)
        text, negative = (torch.randn(1, cfg.text_len, arch["text_dim"], generator=gen)
                          .to(device, dtype) for _ in range(2))
        solver = FlowUniPC(UniPCConfig.from_dict(dict(
            prediction_type="flow_prediction", use_flow_sigmas=True,
            flow_shift=spec["shift"], num_train_timesteps=1000)))
        sigmas, timesteps = solver.make_sigmas(cfg.steps)
        return cls(latents, text, negative, sigmas, timesteps, solver)

    @property
    def num_tokens(self) -> int:
        f, h, w = self.latents.shape[2:]
        return f * (h // 2) * (w // 2)


Velocity = Callable[[Tensor, int], Tensor]     # (latents float32, step) -> guided velocity


def denoise(velocity: Velocity, inputs: Inputs, num_steps: int, device: torch.device,
            label: str, keep: int | None = None) -> tuple[Tensor, list[float], Tensor | None]:
    """The loop: `num_steps` steps of the schedule from the noise -> latents, seconds of each
    step (synchronized), and the latents after `keep` steps (None: not kept)."""
    x, state, seconds, kept = inputs.latents.clone(), inputs.solver.new_state(), [], None
    for i in range(num_steps):
        t0 = now(device)
        v = velocity(x, i)
        x = inputs.solver.step(v, x, inputs.sigmas, i, state).to(x.dtype)
        seconds.append(now(device) - t0)
        log(f"{label}: step {i + 1}/{num_steps} {seconds[-1]:.3f} s")
        if i + 1 == keep:
            kept = x.clone()
    return x, seconds, kept


def per_step(seconds: list[float]) -> float:
    return sum(seconds) / len(seconds)


# ---- diffusers ----------------------------------------------------------------------------

def bench_diffusers(cfg: VideoBenchConfig, spec: dict, inputs: Inputs, device: torch.device,
                    dtype: torch.dtype) -> tuple[dict[str, object], Tensor, dict]:
    """-> timings, its latents after 1 + timed_steps steps, its parameter shapes. The model
    is the caller's to free (gone when this returns)."""
    import diffusers

    from omnistage.models.diffusers_loader import keep_in_fp32

    with torch.device(device), default_dtype(dtype):
        ref = diffusers.WanTransformer3DModel(**spec["arch"]).eval().requires_grad_(False)
    keep_in_fp32(ref, tuple(ref._keep_in_fp32_modules))       # as its from_pretrained
    num_params = seeded_init(ref, cfg.seed)
    names = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    n = inputs.num_tokens

    def velocity(x: Tensor, i: int) -> Tensor:
        t = inputs.timesteps[i].to(device)
        t = t.expand(1, n) if spec["per_token_t"] else t.expand(1)   # TI2V: expand_timesteps
        x = x.to(dtype)
        cond = ref(x, t, inputs.text, return_dict=False)[0]
        uncond = ref(x, t, inputs.negative, return_dict=False)[0]
        return uncond + GUIDANCE * (cond - uncond)

    out: dict[str, object] = {"num_parameters": num_params}
    k = 1 + cfg.timed_steps
    with torch.inference_mode():
        final, seconds, _ = denoise(velocity, inputs, k, device, "diffusers eager")
        out["eager_step_s"] = per_step(seconds[1:])
        out["eager_steps_s"] = seconds
        if cfg.compile_backend:
            t0 = time.perf_counter()
            ref.compile_repeated_blocks(fullgraph=True, backend=cfg.compile_backend)
            _, seconds, _ = denoise(velocity, inputs, k, device, "diffusers compiled")
            out["compiled_step_s"] = per_step(seconds[1:])
            out["compiled_steps_s"] = seconds
            out["compile_and_warmup_s"] = seconds[0]
            out["compiled_total_s"] = time.perf_counter() - t0
    return out, final, names


# ---- ours ---------------------------------------------------------------------------------

def build_ours(cfg: VideoBenchConfig, spec: dict, names: dict, device: torch.device,
               dtype: torch.dtype):
    from omnistage.models.diffusers_loader import keep_in_fp32
    from omnistage.models.wan_transformer import (
        WanTransformer3DModel,
        WanTransformerConfig,
    )

    with torch.device(device), default_dtype(dtype):
        ours = WanTransformer3DModel(WanTransformerConfig.from_dict(spec["arch"]))
    ours = ours.eval().requires_grad_(False)
    keep_in_fp32(ours)
    mine = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    if mine != names:
        raise RuntimeError(f"parameter names differ from diffusers': "
                           f"{sorted(set(mine.items()) ^ set(names.items()))[:6]}")
    seeded_init(ours, cfg.seed)
    return ours


def our_velocity(forward: Callable[..., Tensor], inputs: Inputs, device: torch.device,
                 dtype: torch.dtype, caching: Callable[[int], object] | None = None
                 ) -> Velocity:
    """WanPipeline.velocity for one guided request: rows (cond, uncond) in one call;
    `caching(step)` -> its step-cache groups."""
    text = torch.cat([inputs.text, inputs.negative])

    def velocity(x: Tensor, i: int) -> Tensor:
        t = inputs.timesteps[i].to(device).expand(2)
        kwargs = {} if caching is None else {"step_cache": caching(i)}
        out = forward(torch.cat([x, x]).to(dtype), t, text, **kwargs)
        cond, uncond = out[:1], out[1:]
        return uncond + GUIDANCE * (cond - uncond)

    return velocity


def cache_groups_for(threshold: float, num_steps: int):
    """A request's step-cache groups, cond and uncond, each with its state (the pipeline's
    `cache_groups` for one guided request): step -> groups."""
    from omnistage.layers.step_cache import CacheGroup, StepCacheState

    states = [StepCacheState(), StepCacheState()]

    def groups(i: int) -> list[CacheGroup]:
        must = i == 0 or i == num_steps - 1
        return [CacheGroup(slice(b, b + 1), states[b], threshold, must) for b in range(2)]

    return groups, states


def run_plain(ours, inputs: Inputs, num_steps: int, graphed: bool, device: torch.device,
              dtype: torch.dtype, label: str, keep: int | None = None
              ) -> tuple[Tensor, list[float], Tensor | None]:
    """Ours without caching: a warm-up step (and one that captures its CUDA graph, when
    `graphed`), then `num_steps` timed steps from the noise (`denoise`'s results)."""
    from omnistage.layers.graph_capture import ShapeGraphs

    forward = ShapeGraphs(ours) if graphed else ours
    velocity = our_velocity(forward, inputs, device, dtype)
    denoise(velocity, inputs, 2 if graphed else 1, device, f"{label} warm-up")
    result = denoise(velocity, inputs, num_steps, device, label, keep)
    del forward, velocity
    free_device_memory(device)
    return result


def cached_run(ours, inputs: Inputs, cfg: VideoBenchConfig, threshold: float, published: bool,
               plain: Tensor, step_s: float, device: torch.device, dtype: torch.dtype) -> dict:
    """Ours with step caching over the whole schedule, watching the modulated input or
    (published) the timestep embedding through TeaCache's polynomial."""
    ours.published_teacache = published
    indicator = "timestep embedding, TeaCache's polynomial" if published else "modulated input"
    groups, states = cache_groups_for(threshold, cfg.steps)
    cached, seconds, _ = denoise(our_velocity(ours, inputs, device, dtype, groups), inputs,
                                 cfg.steps, device, f"ours cached ({indicator}, {threshold})")
    return {"indicator": indicator, "threshold": threshold, "step_s": per_step(seconds),
            "speedup_vs_ours": ratio(step_s, per_step(seconds)),
            "steps_skipped": states[0].num_skipped, "steps_skipped_uncond": states[1].num_skipped,
            "latents_psnr_db": psnr(cached.float(), plain.float())}


def bench_cache(ours, inputs: Inputs, cfg: VideoBenchConfig, plain: Tensor, step_s: float,
                device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The modulated input at each threshold in order, until one falls under 30 dB (a larger
    one only skips more); then TeaCache's polynomial where the model has one (what it serves)."""
    from omnistage.models.wan_transformer import teacache_coefficients

    runs = []
    for threshold in cfg.cache_thresholds:
        runs.append(cached_run(ours, inputs, cfg, threshold, False, plain, step_s, device, dtype))
        if runs[-1]["latents_psnr_db"] < 30.0:
            break
    f, h, w = inputs.latents.shape[2:]
    if teacache_coefficients(ours.cfg, (f, h // 2, w // 2)) is not None:
        runs.append(cached_run(ours, inputs, cfg, PUBLISHED_THRESHOLD, True, plain, step_s,
                               device, dtype))
    ours.published_teacache = True
    return runs


def bench_ours(cfg: VideoBenchConfig, spec: dict, names: dict, inputs: Inputs,
               device: torch.device, dtype: torch.dtype) -> tuple[dict[str, object], Tensor]:
    """-> timings and caching results, our latents after 1 + timed_steps steps."""
    ours = build_ours(cfg, spec, names, device, dtype)
    graphed = cfg.cuda_graphs and device.type == "cuda"
    out: dict[str, object] = {"cuda_graphs": graphed}
    with torch.inference_mode():
        plain, seconds, early = run_plain(ours, inputs, cfg.steps, graphed, device, dtype,
                                          "ours", keep=1 + cfg.timed_steps)
        out.update(step_s=per_step(seconds), steps_s=seconds)
        out["step_cache"] = bench_cache(ours, inputs, cfg, plain, out["step_s"], device, dtype)
        if cfg.compile_ours:
            out.update(compiled_ours(ours, inputs, cfg, graphed, device, dtype))
    del ours
    free_device_memory(device)
    return out, early


def compiled_ours(ours, inputs: Inputs, cfg: VideoBenchConfig, graphed: bool,
                  device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Ours with its blocks compiled as a stage's `compile: true` does (inductor; the first
    warm-up step compiles): seconds per step over `timed_steps` steps."""
    from omnistage.diffusion.pipeline import compile_blocks

    t0 = time.perf_counter()
    compile_blocks(ours)
    _, seconds, _ = run_plain(ours, inputs, cfg.timed_steps, graphed, device, dtype,
                              "ours compiled")
    return {"compiled_step_s": per_step(seconds),
            "compiled_total_s": time.perf_counter() - t0}


def best_cache(cache: list[dict]) -> dict | None:
    """The fastest threshold whose latents keep 30 dB; else the best PSNR."""
    good = [c for c in cache if c["latents_psnr_db"] >= 30.0]
    if good:
        return max(good, key=lambda c: c["speedup_vs_ours"])
    return max(cache, key=lambda c: c["latents_psnr_db"]) if cache else None


def bench_model(cfg: VideoBenchConfig, name: str, device: torch.device, dtype: torch.dtype
                ) -> dict[str, object]:
    spec = {**cfg.spec(name), "name": name}
    inputs = Inputs.make(cfg, spec, device, dtype)
    log(f"{name}: latents {tuple(inputs.latents.shape)}, {inputs.num_tokens} tokens a branch")
    ref, ref_latents, names = bench_diffusers(cfg, spec, inputs, device, dtype)
    torch._dynamo.reset()                   # diffusers' model and its compiled blocks freed
    free_device_memory(device)
    ours, our_latents = bench_ours(cfg, spec, names, inputs, device, dtype)
    best = best_cache(ours["step_cache"])
    eager = ref["eager_step_s"]
    result = {
        "shape": spec["arch"], "size": spec["size"], "frames": spec["frames"],
        "latent_shape": list(inputs.latents.shape), "tokens_per_branch": inputs.num_tokens,
        "diffusers": ref, "omnistage": ours, "step_cache_best": best,
        "latents_psnr_vs_diffusers_db": psnr(our_latents.float(), ref_latents.float()),
        "step_speedup_vs_diffusers": ratio(eager, ours["step_s"]),
        "step_speedup_vs_diffusers_compiled": ratio(ref.get("compiled_step_s"),
                                                    ours["step_s"]),
        "compiled_step_speedup_vs_diffusers": ratio(eager, ours.get("compiled_step_s")),
        "compiled_step_speedup_vs_diffusers_compiled": ratio(ref.get("compiled_step_s"),
                                                             ours.get("compiled_step_s")),
        "step_cache_speedup_vs_diffusers": ratio(eager, best["step_s"]) if best else None,
        "step_cache_psnr_db": best["latents_psnr_db"] if best else None,
    }
    log(f"{name}: ours {ours['step_s']:.3f} s/step, diffusers eager {eager:.3f}, "
        f"speed-up {result['step_speedup_vs_diffusers']:.2f}x")
    return result


def run(cfg: VideoBenchConfig) -> dict[str, object]:
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    models = {name: bench_model(cfg, name, device, dtype) for name in cfg.models}
    ratios: dict[str, object] = {}
    for key in ("step_speedup_vs_diffusers", "step_speedup_vs_diffusers_compiled",
                "step_cache_speedup_vs_diffusers", "step_cache_psnr_db",
                "compiled_step_speedup_vs_diffusers",
                "compiled_step_speedup_vs_diffusers_compiled"):
        values = {name: m[key] for name, m in models.items()}
        ratios.update({f"video_{key}_{name}": v for name, v in values.items()})
        known = [v for v in values.values() if v is not None]
        ratios[f"video_{key}"] = min(known) if known else None
    return {
        "benchmark": "video", **environment(device), "dtype": str(dtype).removeprefix("torch."),
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "config": asdict(cfg), "models": models, "ratios": ratios,
        "notes": "per step: one denoising step with CFG (two branches). Speed-ups: diffusers' "
                 "seconds per step over ours (above 1: ours is faster); the headline "
                 "video_* figures are the lowest over the models run, per model under "
                 "video_*_{model}. Compiled: diffusers after compile_repeated_blocks("
                 "fullgraph=True), its compile in the warm-up step. Step cache: ours with "
                 "caching over the whole schedule of config.steps steps, PSNR of its final "
                 "latents against ours without (peak: their range). Random weights: how many "
                 "steps a threshold skips is not what it would skip on the trained model. "
                 "Timesteps: diffusers' TI2V-5B one per token (its expand_timesteps), ours "
                 "one per row (text to video: every token's is the row's). compiled_*: ours "
                 "with compile_blocks (--compile-ours).",
    }
