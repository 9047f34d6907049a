"""Wan2.2-T2V-A14B over several GPUs (issue 26): one 1280x720 video of 81 frames through the
diffusion engine on 1 GPU and on each parallel layout, with diffusers' transformer on 1 GPU as
the reference, in the same call.

    model:      both experts at Wan2.2-T2V-A14B's shape (each Wan2.1-14B's: dim 5120, 40
                layers, 40 heads), random weights (benchmarks/common.py `seeded_tensor`, the
                low-noise expert on another seed), boundary_ratio 0.875, flow shift 5;
                720p x 81 frames = 21 x 45 x 80 = 75,600 tokens a branch, CFG (two branches)
    layouts:    single (1 GPU), ulysses (2: the sequence split), cfg (2: a branch a GPU),
                ulysses4, cfg2xulysses2, tp4, ...: `diffusion_parallel.layout_sizes`. Each is
                its own set of rank processes in one process group, as a stage's ranks;
                rank 0 serves the request through DiffusionEngine, the others follow its
                step plans. Every rank holds both experts (57 GB in bf16; TP splits them).
    timed:      after a 1-step warm-up request, a request of `steps` steps (2 by default: the
                high-noise expert, then the low-noise one): its seconds per step (the
                request's time less its decode), its decode. The layouts decode with a VAE of
                the real factors but 8 base channels (decode runs on rank 0 whatever the
                layout); the real VAE's decode is timed once beside the reference.
    reference:  in a child process on GPU 0 (its memory goes back when it exits): diffusers'
                `WanTransformer3DModel` at the expert's shape, the steps of `WanPipeline`'s
                loop (conditional call, then unconditional), one warm-up then `steps` timed
                (a step runs one expert; both have one shape, so one stands for the two);
                then the real-size VAE decode of the 720p latents by diffusers'
                `AutoencoderKLWan` and by ours (float32, as both pipelines run it).
    reported:   seconds per step per layout, speed-up over 1 GPU and over diffusers, peak
                memory per rank, the final latents' distance to the single-GPU run, and the
                end to end time of Wan2.2's 40-step schedule: 40 x step + the real VAE's
                decode (text encoding, ~0.1 s of UMT5, left out: captions are given).
    profile:    OMNISTAGE_BENCH_PROFILE=DIR writes each rank's kernel table (device time):
                the all-to-all / all-gather kernels there are the communication per step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from omnistage.benchmarks.common import (
    default_dtype,
    environment,
    free_device_memory,
    now,
    ratio,
    seeded_init,
)
from omnistage.benchmarks.diffusion_parallel import (
    _distance,
    _profiled,
    _seeded_load,
    layout_sizes,
    run_layout,
    timed_request,
)
from omnistage.benchmarks.video import COMMON, GUIDANCE
from omnistage.configs.schema import ParallelSizes
from omnistage.utils.device import resolve_device

A14B = dict(arch={**COMMON, "num_attention_heads": 40, "in_channels": 16, "out_channels": 16,
                  "ffn_dim": 13824, "num_layers": 40},
            size=(720, 1280), frames=81, shift=5.0, boundary_ratio=0.875, text_len=512)
TINY = dict(arch={**COMMON, "num_attention_heads": 4, "attention_head_dim": 12, "text_dim": 16,
                  "freq_dim": 32, "ffn_dim": 40, "num_layers": 2, "in_channels": 16,
                  "out_channels": 16},
            size=(32, 48), frames=5, shift=5.0, boundary_ratio=0.875, text_len=8)
FULL_STEPS = 40                     # Wan2.2-T2V-A14B's default num_inference_steps
SMALL_VAE = dict(base_dim=8)        # the layouts' VAE: the real factors, 8 base channels


@dataclass(frozen=True, slots=True)
class VideoParallelConfig:
    sizes: str = "a14b"                       # a14b | tiny
    steps: int = 2
    layouts: tuple[str, ...] = ("ulysses", "ulysses4", "cfg2xulysses2")
    reference: bool = True
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sizes not in ("a14b", "tiny"):
            raise ValueError(f"sizes={self.sizes!r}: choose a14b or tiny")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: must be >= 1")
        for name in self.layouts:
            layout_sizes(name)

    @property
    def spec(self) -> dict:
        return A14B if self.sizes == "a14b" else TINY


def log(message: str) -> None:
    print(f"[bench video-parallel {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr,
          flush=True)


def _captions(cfg: VideoParallelConfig, device: torch.device, dtype: torch.dtype
              ) -> dict[str, Tensor]:
    """The prompt's and negative prompt's UMT5 states (L, text_dim), seeded."""
    gen = torch.Generator().manual_seed(cfg.seed)
    shape = (cfg.spec["text_len"], cfg.spec["arch"]["text_dim"])
    pos, neg = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(2))
    return {"prompt_embeds": pos, "negative_prompt_embeds": neg}


class GivenCaptions:
    """The pipeline's prompt encoder for a benchmark: every prompt's states are the seeded
    captions (`_captions`), as if UMT5 had encoded them."""

    def __init__(self, captions: dict[str, Tensor]) -> None:
        self.captions = captions

    def validate(self, prompt: str, params: object) -> None:
        pass

    def encode(self, prompts: list[str], params: list) -> list[dict[str, Tensor]]:
        return [dict(self.captions) for _ in prompts]


def _solver(cfg: VideoParallelConfig):
    from omnistage.diffusion.solvers.unipc_flow import FlowUniPC, UniPCConfig

    return FlowUniPC(UniPCConfig.from_dict(dict(
        prediction_type="flow_prediction", use_flow_sigmas=True,
        flow_shift=cfg.spec["shift"], num_train_timesteps=1000)))


def _latent_shape(cfg: VideoParallelConfig) -> tuple[int, ...]:
    (height, width), frames = cfg.spec["size"], cfg.spec["frames"]
    return (1, 16, 1 + (frames - 1) // 4, height // 8, width // 8)


# ---- the reference (a child process) ------------------------------------------------------

def bench_reference(cfg: VideoParallelConfig) -> dict[str, object]:
    """diffusers' transformer and both VAEs' real-size decode, in a spawned child process."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_reference_child, (cfg,))


def _reference_child(cfg: VideoParallelConfig) -> dict[str, object]:
    import diffusers

    from omnistage.models.diffusers_loader import keep_in_fp32

    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device), default_dtype(dtype):
        ref = diffusers.WanTransformer3DModel(**cfg.spec["arch"]).eval().requires_grad_(False)
    keep_in_fp32(ref, tuple(ref._keep_in_fp32_modules))
    seeded_init(ref, cfg.seed)
    caps = _captions(cfg, device, dtype)
    solver = _solver(cfg)
    sigmas, timesteps = solver.make_sigmas(cfg.steps + 1)
    gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(_latent_shape(cfg), generator=gen).to(device)
    state, seconds = solver.new_state(), []
    with torch.inference_mode():
        for i in range(cfg.steps + 1):
            t0 = now(device)
            t = timesteps[i].to(device).expand(1)
            xin = x.to(dtype)
            cond = ref(xin, t, caps["prompt_embeds"][None], return_dict=False)[0]
            uncond = ref(xin, t, caps["negative_prompt_embeds"][None], return_dict=False)[0]
            x = solver.step(uncond + GUIDANCE * (cond - uncond), x, sigmas, i, state).to(x.dtype)
            seconds.append(now(device) - t0)
            log(f"diffusers: step {i + 1}/{cfg.steps + 1} {seconds[-1]:.2f} s")
    del ref
    free_device_memory(device)
    out: dict[str, object] = {"seconds_per_step": sum(seconds[1:]) / cfg.steps,
                              "steps_s": seconds}
    out.update(_vae_decodes(cfg, x, device))
    return out


def _vae_decodes(cfg: VideoParallelConfig, latents: Tensor, device: torch.device
                 ) -> dict[str, float]:
    """The real-size VAE's decode of the latents, diffusers' and ours (float32, random)."""
    import diffusers

    from omnistage.models.autoencoder_kl_wan import (
        AutoencoderKLWan,
        AutoencoderKLWanConfig,
    )

    base = {} if cfg.sizes == "a14b" else SMALL_VAE
    out = {}
    with torch.inference_mode():
        for label in ("diffusers", "ours"):
            with torch.device(device):
                vae = (diffusers.AutoencoderKLWan(**base) if label == "diffusers" else
                       AutoencoderKLWan(AutoencoderKLWanConfig(**base))).eval()
            seeded_init(vae, cfg.seed)
            z = latents.float()
            decode = vae.decode
            decode(z[:, :, :2])                  # warm-up: kernels, cuDNN's choices
            t0 = now(device)
            decode(z)
            out[f"{label}_vae_decode_s"] = now(device) - t0
            log(f"{label} VAE decode {out[f'{label}_vae_decode_s']:.2f} s")
            del vae
            free_device_memory(device)
    return out


# ---- one layout's rank ----------------------------------------------------------------------

def _build_expert(cfg: VideoParallelConfig, seed: int, device: torch.device,
                  dtype: torch.dtype):
    """One expert at the spec's shape, for this rank's layout, filled from the seeded whole
    tensors (a TP rank keeps its slice)."""
    import diffusers

    from omnistage.models.diffusers_loader import keep_in_fp32
    from omnistage.models.wan_transformer import (
        WanTransformer3DModel,
        WanTransformerConfig,
    )

    arch = cfg.spec["arch"]
    with torch.device("meta"):
        whole = {n: tuple(p.shape) for n, p in
                 diffusers.WanTransformer3DModel(**arch).named_parameters()}
    with torch.device(device), default_dtype(dtype):
        model = WanTransformer3DModel(WanTransformerConfig.from_dict(arch))
    model = model.eval().requires_grad_(False)
    keep_in_fp32(model)
    _seeded_load(model, whole, seed)
    return model


def rank_main(rank: int, port: int, cfg: VideoParallelConfig, sizes: ParallelSizes,
              out_dir: Path) -> None:
    """One rank of a layout: build the pipeline, serve (rank 0) or follow, write rank{r}.json."""
    from omnistage.diffusion.engine import DiffusionEngine
    from omnistage.diffusion.pipelines.wan import WanPipeline, WanVariant
    from omnistage.layers.groups import init_stage_ranks
    from omnistage.models.autoencoder_kl_wan import (
        AutoencoderKLWan,
        AutoencoderKLWanConfig,
    )

    device = resolve_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ranks = init_stage_ranks(sizes, rank, f"tcp://127.0.0.1:{port}",
                             "nccl" if device.type == "cuda" else "gloo", timeout_s=600.0)
    experts = [_build_expert(cfg, cfg.seed + i, device, dtype) for i in range(2)]
    with torch.device(device):
        vae = AutoencoderKLWan(AutoencoderKLWanConfig(**SMALL_VAE)).eval()
    seeded_init(vae, cfg.seed)
    pipe = WanPipeline(experts[0], vae, GivenCaptions(_captions(cfg, device, dtype)),
                       _solver(cfg), device, experts[1],
                       WanVariant(boundary_ratio=cfg.spec["boundary_ratio"]))
    engine = DiffusionEngine(pipe, ranks=ranks)
    result: dict[str, object] = {"rank": rank}
    with _profiled(f"{out_dir.name}_profile{rank}.txt"):
        if ranks.is_leader:
            result.update(_serve(engine, pipe, cfg, device))
            engine.stop_followers()
        else:
            engine.follow()
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


def _serve(engine, pipe, cfg: VideoParallelConfig, device: torch.device) -> dict[str, object]:
    """A warm-up request of one step, then the timed one; its latents saved for the distance
    to the single-GPU run."""
    from omnistage.diffusion.params import DiffusionParams

    kept: dict[str, object] = {}
    decode = pipe.decode

    def timed_decode(x: Tensor, params) -> Tensor:
        kept["latents"] = x.float().cpu()
        t0 = now(device)
        video = decode(x, params)
        kept["decode_s"] = now(device) - t0
        return video

    pipe.decode = timed_decode
    (height, width), frames = cfg.spec["size"], cfg.spec["frames"]

    def one(rid: str, steps: int) -> float:
        params = DiffusionParams(height=height, width=width, num_frames=frames,
                                 num_inference_steps=steps, seed=cfg.seed,
                                 guidance_scale=GUIDANCE)
        return timed_request(engine, rid, "a video", params, device)

    one("warm", 1)
    total = one("timed", cfg.steps)
    log(f"timed request: {total:.2f} s, decode {kept['decode_s']:.2f} s")
    torch.save(kept["latents"], Path(os.environ["OMNISTAGE_BENCH_OUT"]) / "latents.pt")
    return {"seconds_per_step": (total - float(kept["decode_s"])) / cfg.steps,
            "request_s": total, "small_vae_decode_s": kept["decode_s"]}


# ---- the run -------------------------------------------------------------------------------

def run(cfg: VideoParallelConfig, work_dir: Path,
        progress: Callable[[dict], object] | None = None) -> dict[str, object]:
    """The reference, then 1 GPU and each layout; `progress(result so far)` after each (a run
    cut short keeps what it measured)."""
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result: dict[str, object] = {
        "benchmark": "video_parallel", **environment(device),
        "dtype": str(dtype).removeprefix("torch."),
        "num_gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
        "config": {**asdict(cfg), "spec": cfg.spec, "guidance_scale": GUIDANCE,
                   "tokens_per_branch": _tokens(cfg), "full_steps": FULL_STEPS},
        "reference": bench_reference(cfg) if cfg.reference else None, "layouts": {},
        "notes": "seconds_per_step: one denoising step with CFG (both branches) of the A14B "
                 "expert in turn; speed-ups: 1 GPU's step over the layout's ({layout}_speedup) "
                 "and diffusers' step on 1 GPU over the layout's; e2e_40_steps_s: 40 steps "
                 "plus the real-size VAE decode (ours, or diffusers' for the reference), text "
                 "encoding left out."}
    latents = {}
    for name in ("single", *cfg.layouts):
        log(f"layout {name}")
        res = run_layout(cfg, name, work_dir, "omnistage.benchmarks.video_parallel")
        latents[name] = res.pop("latents")
        if name != "single":
            res.update(_distance(latents[name], latents["single"]))
        result["layouts"][name] = res
        result["ratios"] = _ratios(result["layouts"], result["reference"])
        if progress is not None:
            progress(result)
    return result


def _ratios(layouts: dict[str, dict], ref: dict | None) -> dict[str, float | None]:
    """Speed-ups over 1 GPU and over diffusers (per step, and end to end over 40 steps)."""
    decode_s = (ref or {}).get("ours_vae_decode_s")
    if ref is not None:
        ref["e2e_40_steps_s"] = FULL_STEPS * ref["seconds_per_step"] + \
            ref["diffusers_vae_decode_s"]
    ratios: dict[str, float | None] = {}
    for name, res in layouts.items():
        if name != "single":
            ratios[f"{name}_speedup"] = ratio(layouts["single"]["seconds_per_step"],
                                              res["seconds_per_step"])
        if decode_s is not None:
            res["e2e_40_steps_s"] = FULL_STEPS * res["seconds_per_step"] + decode_s
        if ref is not None:
            ratios[f"{name}_step_speedup_vs_diffusers"] = ratio(ref["seconds_per_step"],
                                                                res["seconds_per_step"])
            ratios[f"{name}_e2e_speedup_vs_diffusers"] = ratio(ref["e2e_40_steps_s"],
                                                               res.get("e2e_40_steps_s"))
    return ratios


def _tokens(cfg: VideoParallelConfig) -> int:
    _, _, f, h, w = _latent_shape(cfg)
    return f * (h // 2) * (w // 2)


if __name__ == "__main__":   # one rank: RANK PORT CONFIG_JSON LAYOUT OUT_DIR
    r, p, c, lay, o = sys.argv[1:6]
    raw = json.loads(c)
    rank_main(int(r), int(p), VideoParallelConfig(**{**raw, "layouts": tuple(raw["layouts"])}),
              layout_sizes(lay), Path(o))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
