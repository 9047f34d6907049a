"""Qwen-Image over several GPUs (issue 18): one 1024x1024 image, 20 steps, true CFG, through
the diffusion engine on 1 GPU and on each parallel layout, with diffusers' transformer in the
same true-CFG loop on 1 GPU as the reference, in the same call.

    layouts:    single (1 GPU), cfg (CFG-parallel 2: a branch per GPU), ulysses (2: the
                sequence split, all-to-all around attention), tp (2: heads and MLPs split),
                ring (2: keys and values passed round); combined with degrees on 4 GPUs
                and more: tp4, ulysses4, cfg2xulysses2 (`layout_sizes`). Each layout is its own set of rank
                processes (`python -m omnistage.benchmarks.diffusion_parallel`), joined in
                one process group as a stage's ranks are; rank 0 serves the request through
                DiffusionEngine, the others follow its step plans.
    weights:    every rank builds our transformer for its layout and fills it from the
                generator seeded by each parameter's name (benchmarks/common.py
                `seeded_tensor`), through the tensor-parallel loaders: a TP rank keeps its slice
                of the same whole tensor every layout and diffusers' model get.
    reference:  diffusers' QwenImageTransformer2DModel, two forwards a step (positive and
                negative caption, as its pipeline runs them) and the norm-preserving combine.
    reported:   seconds per image (after a 2-step warm-up request), peak GPU memory per rank,
                the final latents' distance to the single-GPU run, and
                cfg_parallel_speedup / ulysses_speedup / tp_speedup / ring_speedup: single over
                the layout; each layout's speed-up over diffusers.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from omnistage.benchmarks.common import (default_dtype, environment, free_device_memory, now,
                                         ratio, seeded_init)
from omnistage.benchmarks.diffusion import DiffusionBenchConfig, _denoise, _pipeline, _schedule
from omnistage.configs.schema import ParallelSizes
from omnistage.utils.device import resolve_device

AXIS_NAMES = ("cfg", "ulysses", "ring", "tp")


def layout_sizes(name: str) -> ParallelSizes:
    """A layout's name -> its sizes: "single" (1 GPU); an axis alone ("cfg", "ulysses", "ring",
    "tp": 2 ranks); or axes with their degrees joined by "x" ("tp4", "cfg2xulysses2",
    "ulysses4"), for 4 GPUs and more."""
    if name == "single":
        return ParallelSizes()
    sizes: dict[str, int] = {}
    for part in name.split("x"):
        axis = part.rstrip("0123456789")
        degree = part[len(axis):]
        if axis not in AXIS_NAMES or axis in sizes or (degree and int(degree) < 2):
            raise ValueError(f"layout {name!r}: write single, an axis ({', '.join(AXIS_NAMES)}) "
                             "or axes with degrees joined by x (cfg2xulysses2, tp4)")
        sizes[axis] = int(degree) if degree else 2
    return ParallelSizes(**sizes)


def _speedup_key(name: str) -> str:
    return "cfg_parallel_speedup" if name == "cfg" else f"{name}_speedup"
TRUE_CFG_SCALE = 4.0
RANK_TIMEOUT_S = 480.0


@dataclass(frozen=True, slots=True)
class ParallelBenchConfig:
    sizes: str = "qwen-image"              # qwen-image | tiny
    size: int = 1024
    steps: int = 20
    num_layers: int = 60
    text_len: int = 64
    layouts: tuple[str, ...] = ("cfg", "ulysses", "tp")
    reference: bool = True
    compile: bool = False                  # every layout's blocks compiled (compile_blocks)
    cuda_graphs: bool = True               # forwards replayed from CUDA graphs (on a GPU)
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in self.layouts:
            layout_sizes(name)

    @property
    def diffusion(self) -> DiffusionBenchConfig:
        return DiffusionBenchConfig(sizes=self.sizes, size=self.size, steps=self.steps,
                                    num_layers=self.num_layers, text_len=self.text_len,
                                    vae_base_dim=8 if self.sizes == "tiny" else 16,
                                    device=self.device, seed=self.seed)


def _captions(cfg: ParallelBenchConfig, device: torch.device, dtype: torch.dtype
              ) -> tuple[Tensor, Tensor, Tensor]:
    """(initial latents (1, N, C), prompt states (T, J), negative prompt states (T, J))."""
    arch = cfg.diffusion.transformer
    grid = cfg.size // 16
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    latents = torch.randn(1, grid * grid, int(arch["in_channels"]), generator=gen)
    pos, neg = (torch.randn(cfg.text_len, int(arch["joint_attention_dim"]), generator=gen)
                for _ in range(2))
    return latents.to(device, dtype), pos.to(device, dtype), neg.to(device, dtype)


def _combine(pos: Tensor, neg: Tensor) -> Tensor:
    """Qwen-Image's true CFG: the guided prediction rescaled to the positive one's norm."""
    comb = neg + TRUE_CFG_SCALE * (pos - neg)
    return comb * (pos.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))


def bench_reference(cfg: ParallelBenchConfig, device: torch.device, dtype: torch.dtype) -> dict:
    """diffusers' transformer in the true-CFG Euler loop: seconds per image (after a warm-up)."""
    import diffusers

    arch = cfg.diffusion.transformer
    latents, pos, neg = _captions(cfg, device, dtype)
    shapes = [[(1, cfg.size // 16, cfg.size // 16)]]
    with torch.device(device), default_dtype(dtype):
        ref = diffusers.QwenImageTransformer2DModel(**arch).eval()
    seeded_init(ref, cfg.seed)

    def forward(x: Tensor, t: Tensor) -> Tensor:
        out = [ref(hidden_states=x, encoder_hidden_states=c[None], encoder_hidden_states_mask=None,
                   timestep=t, img_shapes=shapes, return_dict=False)[0] for c in (pos, neg)]
        return _combine(*out)

    sigmas = _schedule(cfg.diffusion)
    with torch.inference_mode():
        _denoise(forward, latents, sigmas[:3], device)
        final, seconds = _denoise(forward, latents, sigmas, device)
    del ref
    free_device_memory(device)
    return {"seconds_per_image": seconds, "latents": final}


# ---- one layout: its rank processes ---------------------------------------------------------

def _seeded_load(model: torch.nn.Module, whole: dict[str, tuple[int, ...]], seed: int) -> None:
    """Each parameter from the same seeded whole tensor as `seeded_init` draws for a model of
    the whole shapes, through its tensor-parallel loader when it has one (this rank's slice)."""
    from omnistage.benchmarks.common import seeded_tensor

    for module_name, module in model.named_modules():
        is_norm = "norm" in type(module).__name__.lower()
        for leaf, p in module.named_parameters(recurse=False):
            name = f"{module_name}.{leaf}" if module_name else leaf
            full = seeded_tensor(name, whole[name], is_norm and leaf != "bias", seed, p.device)
            loader = getattr(p, "weight_loader", None)
            with torch.no_grad():
                if loader is not None:
                    loader(p, full.to(p.dtype))
                else:
                    p.copy_(full)


def _whole_shapes(arch: dict) -> dict[str, tuple[int, ...]]:
    import diffusers

    with torch.device("meta"):
        ref = diffusers.QwenImageTransformer2DModel(**arch)
    return {n: tuple(p.shape) for n, p in ref.named_parameters()}


def rank_main(rank: int, port: int, cfg: ParallelBenchConfig, sizes: ParallelSizes,
              out_dir: Path) -> None:
    """One rank of a layout: build, serve (rank 0) or follow, write rank{r}.json."""
    from omnistage.diffusion.engine import DiffusionEngine
    from omnistage.layers.groups import init_stage_ranks
    from omnistage.models.qwen_image_transformer import (QwenImageTransformer2DModel,
                                                         QwenImageTransformerConfig)

    device = resolve_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ranks = init_stage_ranks(sizes, rank, f"tcp://127.0.0.1:{port}",
                             "nccl" if device.type == "cuda" else "gloo")
    arch = cfg.diffusion.transformer
    with torch.device(device), default_dtype(dtype):
        model = QwenImageTransformer2DModel(QwenImageTransformerConfig.from_dict(arch)).eval()
    _seeded_load(model, _whole_shapes(arch), cfg.seed)
    if cfg.compile:   # the blocks' host work shrinks: what a rank of half the work waits on
        from omnistage.diffusion.pipeline import compile_blocks

        compile_blocks(model)
    pipe = _pipeline(model, cfg.diffusion, device, dtype)
    if cfg.cuda_graphs and device.type == "cuda":
        pipe.use_cuda_graphs()
    engine = DiffusionEngine(pipe, ranks=ranks)
    result: dict[str, object] = {"rank": rank}
    with _profiled(f"{out_dir.name}_profile{rank}.txt"):
        if ranks.is_leader:
            result.update(_serve(engine, pipe, cfg, device, dtype))
            engine.stop_followers()
        else:
            engine.follow()
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


@contextlib.contextmanager
def _profiled(name: str):
    """OMNISTAGE_BENCH_PROFILE=DIR: torch.profiler's tables of the rank's run (device time,
    then host time) written to DIR/name, to see where a layout's step time goes."""
    folder = os.environ.get("OMNISTAGE_BENCH_PROFILE")
    if not folder:
        yield
        return
    path = Path(folder) / name
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25)
    path.write_text(table + "\n" + prof.key_averages().table(sort_by="self_cpu_time_total",
                                                             row_limit=25))


def _serve(engine, pipe, cfg: ParallelBenchConfig, device: torch.device, dtype: torch.dtype
           ) -> dict[str, object]:
    from omnistage.diffusion.params import DiffusionParams

    _, pos, neg = _captions(cfg, device, dtype)
    kept: dict[str, Tensor] = {}
    decode = pipe.decode

    def spy(x: Tensor, params) -> Tensor:
        kept["latents"] = x.float().cpu()
        return decode(x, params)

    pipe.decode = spy

    def one(rid: str, steps: int) -> float:
        params = DiffusionParams(height=cfg.size, width=cfg.size, num_inference_steps=steps,
                                 seed=cfg.seed, true_cfg_scale=TRUE_CFG_SCALE,
                                 negative_prompt=" ")
        return timed_request(engine, rid, None, params, device,
                             {"prompt_embeds": pos, "negative_prompt_embeds": neg})

    one("warm", 2)
    seconds = one("timed", cfg.steps)
    torch.save(kept["latents"], Path(os.environ["OMNISTAGE_BENCH_OUT"]) / "latents.pt")
    return {"seconds_per_image": seconds}


def timed_request(engine, rid: str, prompt: str | None, params, device: torch.device,
                  conditioning: dict[str, Tensor] | None = None) -> float:
    """One request through the leader's engine to its end (its caption states given when
    `conditioning`): seconds, synchronized; a failed request raises."""
    t0 = now(device)
    engine.add_request(rid, prompt, params)
    if conditioning is not None:
        engine.set_conditioning(rid, conditioning)
    while engine.has_unfinished_requests:
        for r in engine.step():
            if r.finished and r.error:
                raise RuntimeError(f"{rid}: {r.error}")
    return now(device) - t0


def run_layout(cfg: object, name: str, out_dir: Path,
               module: str = "omnistage.benchmarks.diffusion_parallel") -> dict[str, object]:
    """Start the layout's rank processes (`python -m module RANK PORT CONFIG LAYOUT DIR`),
    wait (with a deadline), read what they wrote: rank 0's results, each rank's peak memory,
    the final latents."""
    from omnistage.testing.processes import free_port
    from omnistage.testing.ranks import wait_all

    sizes = layout_sizes(name)
    folder = out_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = dict(os.environ, OMNISTAGE_BENCH_OUT=str(folder))
    procs = [subprocess.Popen([sys.executable, "-m", module, str(r), str(port),
                               json.dumps(asdict(cfg)), name, str(folder)],
                              env=env)
             for r in range(sizes.world_size)]
    wait_all(procs, RANK_TIMEOUT_S)
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"layout {name}: rank(s) {bad} failed (their stderr is above)")
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(len(procs))]
    leader = {k: v for k, v in ranks[0].items() if k not in ("rank", "peak_memory_gib")}
    return {"sizes": asdict(sizes), **leader,
            "peak_memory_gib_per_rank": [r.get("peak_memory_gib") for r in ranks],
            "latents": torch.load(folder / "latents.pt")}


def _distance(a: Tensor, b: Tensor) -> dict[str, float]:
    mse = float((a.double() - b.double()).pow(2).mean())
    peak = float(b.max() - b.min())
    return {"rel_diff": float((a - b).norm() / b.norm()),
            "psnr_db": math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)}


def run(cfg: ParallelBenchConfig, out_dir: Path) -> dict[str, object]:
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ref = bench_reference(cfg, device, dtype) if cfg.reference else None
    layouts = {name: run_layout(cfg, name, out_dir) for name in ("single", *cfg.layouts)}
    base = layouts["single"]
    ratios: dict[str, float | None] = {}
    for name, res in layouts.items():
        res.update(_distance(res.pop("latents"), base["latents"]) if name != "single" else {})
        if name != "single":
            ratios[_speedup_key(name)] = ratio(
                base["seconds_per_image"], res["seconds_per_image"])
        if ref is not None:
            ratios[f"{name}_speedup_vs_diffusers"] = ratio(ref["seconds_per_image"],
                                                           res["seconds_per_image"])
    if ref is not None:     # its own initial noise: timing only (`bench diffusion` compares
        ref.pop("latents")  # the transformers on the same latents)
    base.pop("latents")
    return {"benchmark": "diffusion_parallel", **environment(device),
            "dtype": str(dtype).removeprefix("torch."),
            "num_gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
            "config": {**asdict(cfg), "transformer": cfg.diffusion.transformer,
                       "true_cfg_scale": TRUE_CFG_SCALE},
            "reference": ref, "layouts": layouts, "ratios": ratios,
            "notes": "speed-ups: single-GPU seconds over the layout's (cfg_parallel_speedup, "
                     "ulysses_speedup, tp_speedup, ring_speedup) and diffusers' over each "
                     "layout's; one request, true CFG; the time includes the small random VAE's "
                     "decode, not text encoding (caption states given)."}


if __name__ == "__main__":   # one rank: RANK PORT CONFIG_JSON LAYOUT OUT_DIR
    r, p, c, lay, o = sys.argv[1:6]
    rank_main(int(r), int(p), ParallelBenchConfig(**{**json.loads(c), "layouts": tuple(
        json.loads(c)["layouts"])}), layout_sizes(lay), Path(o))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
