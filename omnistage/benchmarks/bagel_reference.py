"""The upstream side of omnistage/benchmarks/bagel.py, run by the reference's own interpreter
(torch and transformers as the upstream pins them; see docs/models/bagel.md): builds the
upstream model as scripts/bagel_fixtures.py does (its tiny config, weights drawn from its seed;
flash-attn replaced by SDPA), saves the checkpoint folder for ours to load, and times 1 +
`images` text-to-image calls of its InterleaveInferencer (the first a warm-up): seconds per
image, the instants of its denoising steps (`_forward_flow` calls), and the warm-up's image.

    <reference python> bagel_reference.py ROOT      # reads ROOT/job.json, writes ROOT/reference.json
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch


def _fixtures(script: str):
    spec = importlib.util.spec_from_file_location("bagel_fixtures", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(root: Path) -> None:
    job = json.loads((root / "job.json").read_text())
    fx = _fixtures(job["fixtures_script"])
    torch.set_grad_enabled(False)
    up = fx.import_upstream(Path(job["upstream"]).resolve())
    model, vae, ema, ae = fx.build(up)
    fx.save_checkpoint(root / "ckpt", ema, ae)
    inf = up.inferencer.InterleaveInferencer(
        model, vae, fx.ByteTokenizer(), fx.ImageTransform(model.latent_downsample),
        fx.ImageTransform(model.vit_patch_size), dict(fx.SPECIAL))
    stamps: list[float] = []
    flow = model._forward_flow

    def timed_flow(*args, **kwargs):
        stamps.append(time.perf_counter())
        return flow(*args, **kwargs)

    model._forward_flow = timed_flow
    image_s, step_s, first = [], [], None
    for i in range(1 + job["images"]):
        stamps.clear()
        torch.manual_seed(job["seed"] + i)
        t0 = time.perf_counter()
        out = inf.interleave_inference(
            [job["prompt"]], image_shapes=tuple(job["size"]), num_timesteps=job["steps"] + 1,
            timestep_shift=job["timestep_shift"], cfg_text_scale=job["guidance_scale"],
            cfg_img_scale=1.0, cfg_interval=job["cfg_interval"], cfg_renorm_min=0.0,
            cfg_renorm_type="global")
        image_s.append(time.perf_counter() - t0)
        step_s.append([b - a for a, b in zip(stamps, stamps[1:])])
        first = out[-1] if first is None else first
    (root / "reference.json").write_text(json.dumps({
        "image_s": image_s, "step_s": step_s, "peak_memory_bytes": None,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "image": np.asarray(first).tolist()}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
