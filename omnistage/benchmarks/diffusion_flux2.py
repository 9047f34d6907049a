"""FLUX.2 [klein]'s transformer, ours against diffusers' on the same random weights, and our
diffusion engine on it: `omnistage bench diffusion --model flux2-klein`. The method is
diffusion.py's (Qwen-Image) with FLUX.2's pieces:

    1. transformer:  the same flow-match Euler loop (FLUX.2's empirical-mu schedule for the
                     image size; 4 steps by default, as the step-distilled klein 4B is run)
                     around diffusers' Flux2Transformer2DModel, then around ours at the klein
                     4B shape (5 double, 20 single blocks, 24 heads x 128, text 3 x 2560):
                     seconds per image, and how far apart their final latents are
    2. engine:       DiffusionEngine + Flux2KleinPipeline (step-distilled: no CFG) with our
                     transformer, a small random FLUX.2 VAE and no text encoder, each request
                     given its text states directly: one image alone, step caching, step-level
                     batching (diffusion.engine_figures)

Weights come from `seeded_init` (same names, same weights, one model in memory at a time), in
bf16 on a GPU. Captions of `text_len` tokens (the pipeline pads to 512; fewer keeps the text
side from dominating a 4-step run).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import Tensor

from omnistage.benchmarks.common import (default_dtype, environment, free_device_memory, ratio,
                                         seeded_init)
from omnistage.benchmarks.diffusion import _denoise, engine_figures, psnr
from omnistage.utils.device import resolve_device

# black-forest-labs/FLUX.2-klein-4B's transformer (the others are diffusers' defaults)
KLEIN_4B = dict(in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=7680, guidance_embeds=False)
TINY = dict(in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=False)
# FLUX.2's scheduler_config.json (FlowMatchEulerDiscreteScheduler, mu from the pipeline)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                 time_shift_type="exponential")


@dataclass(frozen=True, slots=True)
class Flux2BenchConfig:
    sizes: str = "klein-4b"               # klein-4b | tiny
    size: int = 1024                      # pixels, square
    steps: int = 4
    text_len: int = 64
    cache_thresholds: tuple[float, ...] = (0.1, 0.2, 0.4, 0.8)
    concurrency: int = 4
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sizes not in ("klein-4b", "tiny"):
            raise ValueError(f"sizes={self.sizes!r}: choose klein-4b or tiny")
        if self.size <= 0 or self.size % 16:
            raise ValueError(f"size={self.size}: must be a positive multiple of 16")
        if self.steps < 2:
            raise ValueError(f"steps={self.steps}: must be >= 2")
        if self.text_len < 1 or self.concurrency < 1:
            raise ValueError("text_len and concurrency must be >= 1")

    @property
    def transformer(self) -> dict[str, object]:
        return TINY if self.sizes == "tiny" else KLEIN_4B


def _inputs(cfg: Flux2BenchConfig, device: torch.device, dtype: torch.dtype
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """latents (1, N, C), text (1, T, J), img_ids (N, 4), txt_ids (T, 4), sigmas (steps+1,)."""
    from omnistage.diffusion.pipelines.flux2 import (compute_empirical_mu, position_ids,
                                                     text_ids)
    from omnistage.diffusion.solvers import flow_match_euler as solver

    arch, grid = cfg.transformer, cfg.size // 16
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    latents = torch.randn(1, grid * grid, int(arch["in_channels"]), generator=gen)
    text = torch.randn(1, cfg.text_len, int(arch["joint_attention_dim"]), generator=gen)
    sigmas, _ = solver.make_sigmas(
        solver.FlowMatchEulerConfig.from_dict(SCHEDULER), cfg.steps,
        mu=compute_empirical_mu(grid * grid, cfg.steps),
        sigmas=np.linspace(1.0, 1 / cfg.steps, cfg.steps))
    return (latents.to(device, dtype), text.to(device, dtype),
            position_ids(0, grid, grid).to(device, dtype),
            text_ids(cfg.text_len).to(device, dtype), sigmas)


def bench_transformers(cfg: Flux2BenchConfig, device: torch.device, dtype: torch.dtype
                       ) -> tuple[dict[str, object], torch.nn.Module, Tensor]:
    """-> timings and latent agreement, our transformer (kept for the engine), the text
    states (1, T, J) both ran with."""
    import diffusers

    from omnistage.models.flux2_transformer import (Flux2Transformer2DModel,
                                                    Flux2TransformerConfig)

    latents, text, img_ids, txt_ids, sigmas = _inputs(cfg, device, dtype)

    def timed(forward) -> tuple[Tensor, float]:
        with torch.inference_mode():
            _denoise(forward, latents, sigmas[:3], device)                  # warm-up
            return _denoise(forward, latents, sigmas, device)

    with torch.device(device), default_dtype(dtype):
        ref = diffusers.Flux2Transformer2DModel(**cfg.transformer).eval()
    num_params = seeded_init(ref, cfg.seed)
    ref_final, ref_s = timed(lambda x, t: ref(
        hidden_states=x, encoder_hidden_states=text, timestep=t, img_ids=img_ids,
        txt_ids=txt_ids, return_dict=False)[0])
    names = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    ref = None
    free_device_memory(device)

    with torch.device(device), default_dtype(dtype):
        ours = Flux2Transformer2DModel(Flux2TransformerConfig.from_dict(cfg.transformer)).eval()
    mine = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    if mine != names:
        raise RuntimeError(f"parameter names differ from diffusers': "
                           f"{sorted(set(mine.items()) ^ set(names.items()))[:6]}")
    seeded_init(ours, cfg.seed)
    final, ours_s = timed(lambda x, t: ours(x, text, t, img_ids, txt_ids))
    a, b = final.float(), ref_final.float()
    return {"diffusers_s": ref_s, "omnistage_s": ours_s, "num_parameters": num_params,
            "latents_rel_diff": float((a - b).norm() / b.norm()), "latents_psnr_db": psnr(a, b),
            "speedup": ratio(ref_s, ours_s)}, ours, text


def _pipeline(transformer: torch.nn.Module, cfg: Flux2BenchConfig, device: torch.device,
              dtype: torch.dtype):
    """Flux2KleinPipeline around our transformer, step-distilled (no CFG), with a small
    random FLUX.2 VAE of the real latent layout and no text encoder."""
    from omnistage.diffusion.pipelines.flux2 import Flux2KleinPipeline
    from omnistage.diffusion.solvers.flow_match_euler import FlowMatchEulerConfig
    from omnistage.models.autoencoder_kl_flux2 import (AutoencoderKLFlux2,
                                                       AutoencoderKLFlux2Config)

    blocks = ("DownEncoderBlock2D",) * 4, ("UpDecoderBlock2D",) * 4
    vae_cfg = AutoencoderKLFlux2Config(
        down_block_types=blocks[0], up_block_types=blocks[1], block_out_channels=(8,) * 4,
        latent_channels=int(cfg.transformer["in_channels"]) // 4, norm_num_groups=4,
        sample_size=cfg.size)
    with torch.device(device), default_dtype(dtype):
        vae = AutoencoderKLFlux2(vae_cfg).eval()
    seeded_init(vae, cfg.seed + 1)
    pipe = Flux2KleinPipeline(transformer, vae, None, FlowMatchEulerConfig.from_dict(SCHEDULER),
                              device)
    pipe.is_distilled = True
    return pipe


def run(cfg: Flux2BenchConfig) -> dict[str, object]:
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    transformer_result, ours, text = bench_transformers(cfg, device, dtype)
    engine_result, _ = engine_figures(_pipeline(ours, cfg, device, dtype), text, cfg, device)
    del ours
    free_device_memory(device)
    best = engine_result["step_cache_best_at_30db"]
    ratios = {"transformer_speedup_vs_diffusers": transformer_result["speedup"],
              "engine_seconds_per_image_vs_diffusers": ratio(
                  transformer_result["diffusers_s"], engine_result["seconds_per_image"]),
              "step_cache_speedup_at_30db": best["speedup"] if best else None,
              "batching_speedup": engine_result["batching"]["speedup"]}
    return {
        "benchmark": "diffusion", "model": "flux2-klein", **environment(device),
        "dtype": str(dtype).removeprefix("torch."),
        "config": {**asdict(cfg), "transformer": cfg.transformer, "scheduler": SCHEDULER},
        "transformer": transformer_result, "engine": engine_result, "ratios": ratios,
        "notes": "speedups: diffusers' seconds over ours (above 1: ours is faster). The engine "
                 "runs the klein pipeline step-distilled (no CFG), as FLUX.2-klein-4B is "
                 "served; its VAE is small and random (the decode is not the real one's).",
    }
