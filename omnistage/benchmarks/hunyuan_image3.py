"""HunyuanImage-3.0 text-to-image, ours against the upstream code (Tencent-Hunyuan/HunyuanImage-3.0,
trust-remote-code, in its own environment) on the same random weights, in the same run: seconds
per image (template, prefix, steps with CFG, VAE decode) and per denoising step, and the memory
each takes.

    1. hunyuan_image3_reference.py (the reference's interpreter) builds the upstream model at
       the chosen shape, draws its weights from a seed, saves the checkpoint folder, and times
       1 + `images` upstream generations one at a time (the first a warm-up);
    2. ours loads that folder (our loader, as `omnistage serve` does) and runs the same requests
       through the diffusion engine (HunyuanImage3Pipeline), one at a time, timed the same way;
       a step is one engine step past the first (the first also runs the prompt's prefix) and
       before the last (which decodes); upstream's, the interval between its scheduler's steps.

Shape: the released model's layers (`REAL`: hidden 4096, 32 heads / 8 kv heads of 128, 64
experts top-8 of width 3072 plus a shared one; VAE factor 16) with `--layers` of its 32 decoder
layers (the 80B whole does not fit one GPU, and upstream splits it by device_map), 1024x1024
(4,096 image tokens), bfloat16 on a GPU. `--config FILE` takes a checkpoint's config.json
instead. `--tiny`: the test fixtures' 2-layer model at 32x32 in float32, for a CPU.

The reference's interpreter: $OMNISTAGE_HI3_REF_PYTHON, else /work/ref-hi3/venv/bin/python;
its checkout: --upstream (default /work/ref-hi3/src), at the commit the fixtures name.

    python -m omnistage.benchmarks.hunyuan_image3 [--tiny] [--layers N] [--steps N]
        [--images N] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from omnistage.benchmarks.common import (environment, free_device_memory, median, now, ratio)
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.hunyuan_image3 import HunyuanImage3Pipeline
from omnistage.utils.device import resolve_device

REFERENCE_SCRIPT = Path(__file__).with_name("hunyuan_image3_reference.py")
REFERENCE_PYTHON = Path("/work/ref-hi3/venv/bin/python")
UPSTREAM = Path("/work/ref-hi3/src")
REFERENCE_TIMEOUT_S = 3600
# the released config.json's shape (decoder layers set by --layers); the rest as the fixtures'
REAL = dict(hidden_size=4096, intermediate_size=3072, moe_intermediate_size=3072,
            num_attention_heads=32, num_key_value_heads=8, attention_head_dim=128,
            num_experts=64, moe_topk=8, num_shared_expert=1, max_position_embeddings=22800,
            vocab_size=133120, image_base_size=1024, vae_downsample_factor=[16, 16],
            patch_embed_hidden_dim=1024,
            vae=dict(in_channels=3, out_channels=3, latent_channels=32,
                     block_out_channels=[128, 256, 512, 1024, 1024], layers_per_block=2,
                     ffactor_spatial=16, ffactor_temporal=4, sample_size=384, sample_tsize=96,
                     scaling_factor=0.562679178327931, shift_factor=None,
                     downsample_match_channel=True, upsample_match_channel=True))
PROMPT = "a painting of a red cat on a small house over the river"   # the tiny tokenizer's words


@dataclass(frozen=True, slots=True)
class HunyuanImage3BenchConfig:
    tiny: bool = False
    layers: int = 2
    steps: int = 10
    images: int = 2                 # timed images, after one warm-up
    guidance_scale: float = 5.0
    flow_shift: float = 3.0
    device: str = "auto"
    seed: int = 0
    config: str | None = None       # a checkpoint's config.json (its shape, random weights)
    upstream: str = str(UPSTREAM)

    def arch(self) -> dict:
        """Overrides of the fixtures' tiny config (hunyuan_image3_reference.py applies them)."""
        if self.tiny:
            return {}
        if self.config:
            raw = json.loads(Path(self.config).read_text())
            keep = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map")}
            return dict(keep, num_hidden_layers=self.layers)
        return dict(REAL, num_hidden_layers=self.layers)

    def size(self) -> list[int]:
        base = 32 if self.tiny else self.arch().get("image_base_size", 1024)
        return [base, base]


def reference_python() -> str:
    return os.environ.get("OMNISTAGE_HI3_REF_PYTHON") or (
        str(REFERENCE_PYTHON) if REFERENCE_PYTHON.is_file() else sys.executable)


def run_reference(root: Path, cfg: HunyuanImage3BenchConfig, device: torch.device) -> dict:
    """The upstream side (module docstring, 1.): its raw timings; the folder is root/ckpt."""
    (root / "job.json").write_text(json.dumps({
        "upstream": cfg.upstream, "device": str(device), "config": cfg.arch(), "seed": cfg.seed,
        "prompt": PROMPT, "size": cfg.size(), "steps": cfg.steps,
        "guidance_scale": cfg.guidance_scale, "flow_shift": cfg.flow_shift,
        "images": cfg.images, "image_seed": cfg.seed + 1}))
    python = reference_python()
    done = subprocess.run([python, str(REFERENCE_SCRIPT), str(root)], capture_output=True,
                          text=True, timeout=REFERENCE_TIMEOUT_S, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise RuntimeError(f"the HunyuanImage-3.0 reference ({python}) failed (exit "
                           f"{done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return json.loads((root / "reference.json").read_text())


def run_ours(folder: Path, cfg: HunyuanImage3BenchConfig, device: torch.device,
             dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    """Ours (module docstring, 2.): timings, and the warm-up's final latents and image."""
    pipe = HunyuanImage3Pipeline.from_pretrained(folder, "hunyuan_image3", device, dtype)
    engine, kept = DiffusionEngine(pipe), {}
    decode = pipe.decode

    vae = pipe.model.cfg.vae

    def keep(x: torch.Tensor, params: DiffusionParams) -> torch.Tensor:
        image = decode(x, params)        # latents kept in upstream's scale (its VAE's input)
        kept.setdefault("latents", x.float().cpu() / vae.scaling_factor
                        + vae.shift_factor)
        kept.setdefault("image", image)
        return image

    pipe.decode = keep
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    h, w = cfg.size()
    image_s, step_s = [], []
    for i in range(1 + cfg.images):
        params = DiffusionParams(height=h, width=w, num_inference_steps=cfg.steps,
                                 guidance_scale=cfg.guidance_scale, flow_shift=cfg.flow_shift,
                                 seed=cfg.seed + 1 + i)
        t0, stamps = now(device), []
        engine.add_request(f"image-{i}", PROMPT, params)
        while engine.has_unfinished_requests:
            (result,) = engine.step()
            assert result.error is None, result.error
            stamps.append(now(device))
        image_s.append(stamps[-1] - t0)
        step_s.append([b - a for a, b in zip(stamps[:-2], stamps[1:-1])])
    out = {"image_s": image_s, "step_s": step_s,
           "peak_memory_bytes": (torch.cuda.max_memory_allocated(device)
                                 if device.type == "cuda" else None),
           "num_parameters": sum(p.numel() for p in pipe.model.parameters())}
    del pipe, engine
    free_device_memory(device)
    return out, kept


def summarize(raw: dict) -> dict:
    """Per image and per step: the timed runs' medians (the warm-up's kept apart)."""
    steps = [s for run in raw["step_s"][1:] for s in run]
    return {**raw, "warmup_image_s": raw["image_s"][0], "per_image_s": median(raw["image_s"][1:]),
            "per_step_s": median(steps)}


def run(cfg: HunyuanImage3BenchConfig) -> dict[str, object]:
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(prefix="hi3-bench-") as tmp:
        root = Path(tmp)
        ref = summarize(run_reference(root, cfg, device))
        ref_kept = load_file(str(root / "reference.safetensors"))
        ours, kept = run_ours(root / "ckpt", cfg, device, dtype)
        ours = summarize(ours)
    ref_image = ((ref_kept["image"][:, :, 0] / 2 + 0.5).clamp(0, 1) * 255).round()
    ref_image = ref_image.permute(0, 2, 3, 1)                # (1, H, W, 3), as ours decodes
    ratios = {
        "hunyuan_image3_speedup_vs_reference": ratio(ref["per_image_s"], ours["per_image_s"]),
        "hunyuan_image3_step_speedup_vs_reference": ratio(ref["per_step_s"], ours["per_step_s"]),
    }
    return {
        "benchmark": "hunyuan_image3", **environment(device),
        "dtype": str(dtype).removeprefix("torch."), "config": asdict(cfg),
        "shape": {"layers": cfg.layers if not cfg.tiny else 2, "size": cfg.size(),
                  "steps": cfg.steps},
        "reference": ref, "ours": ours, "ratios": ratios,
        "max_abs_diff": {
            "latents": float((kept["latents"] - ref_kept["latents"][:, :, 0]).abs().max()),
            "image": float((kept["image"].float() - ref_image).abs().max())},
        "peak_memory_bytes": {"reference": ref["peak_memory_bytes"],
                              "ours": ours["peak_memory_bytes"]},
        "notes": "one image at a time, both sides, on the same random weights (the reference "
                 "draws them, ours loads its saved folder). Speed-ups: the reference's seconds "
                 "over ours (above 1: ours faster), medians of the timed images and of their "
                 "steps past the first (ours: engine steps between the first, which runs the "
                 "prompt's prefix, and the last, which decodes; upstream: intervals between its "
                 "scheduler's steps). max_abs_diff: the warm-up image (same seed), latents and "
                 "uint8 pixels; in bfloat16 the two differ by rounding.",
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the fixtures' model, for a CPU")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the real 32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--images", type=int, default=2, help="timed images after a warm-up")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--config", default=None, help="a checkpoint's config.json (shape)")
    parser.add_argument("--upstream", default=str(UPSTREAM), help="the upstream checkout")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run(HunyuanImage3BenchConfig(
        tiny=args.tiny, layers=args.layers, steps=args.steps, images=args.images,
        device=args.device, config=args.config, upstream=args.upstream))
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text, file=sys.stdout)
    return result


if __name__ == "__main__":
    main()
