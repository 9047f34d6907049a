"""BAGEL text-to-image, ours against the upstream code (ByteDance-Seed/Bagel, in its own
environment) on the same random weights, in the same run: seconds per image (contexts, guided
flow steps, VAE decode) and per denoising step, and the memory each takes.

    1. bagel_reference.py (the reference's interpreter) builds the upstream model as
       scripts/bagel_fixtures.py does (its tiny MoT config, weights drawn from its seed), saves
       the checkpoint folder, and times 1 + `images` InterleaveInferencer calls one at a time
       (the first a warm-up); a step is the interval between its `_forward_flow` calls;
    2. ours loads that folder (Bagel.from_pretrained, our loader) and runs the same requests
       through the diffusion engine (BagelPipeline), one at a time, timed the same way; a step
       is one engine step past the first (which also builds the contexts) and before the last
       (which decodes).

Shape: the fixtures' (`--tiny`; 2 layers, hidden 64, float32), the only one the reference
builds here: the 7B shape needs the upstream checkout and its environment on the GPU machine
(docs/models/bagel.md says how; `--upstream`, $OMNISTAGE_BAGEL_REF_PYTHON).

    python -m omnistage.benchmarks.bagel --tiny [--steps N] [--images N] [--out FILE.json]
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

from omnistage.benchmarks.common import environment, free_device_memory, median, now, ratio
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.bagel import BagelOptions, BagelPipeline
from omnistage.models.bagel.model import Bagel
from omnistage.utils.device import resolve_device

REFERENCE_SCRIPT = Path(__file__).with_name("bagel_reference.py")
FIXTURES_SCRIPT = Path(__file__).parents[2] / "scripts" / "bagel_fixtures.py"
REFERENCE_PYTHON = Path("/work/ref-bagel/venv/bin/python")
UPSTREAM = Path("/work/ref-bagel/Bagel")
REFERENCE_TIMEOUT_S = 3600
PROMPT = "a red cube on a blue table"
# the fixtures' special token ids (scripts/bagel_fixtures.py's byte tokenizer)
SPECIAL = {"<|im_start|>": 256, "<|im_end|>": 257, "<|vision_start|>": 258,
           "<|vision_end|>": 259}


class ByteTokens:
    """The fixtures' tokenizer: byte b is id b, the four special tokens at 256.."""
    unk_token_id = None

    def convert_tokens_to_ids(self, token: str) -> int:
        return SPECIAL[token]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))


@dataclass(frozen=True)
class BagelBenchConfig:
    tiny: bool = True
    steps: int = 10
    images: int = 2
    size: tuple[int, int] = (32, 32)
    guidance_scale: float = 4.0
    timestep_shift: float = 3.0
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    seed: int = 0
    device: str = "auto"
    upstream: str = str(UPSTREAM)


def reference_python() -> str:
    return os.environ.get("OMNISTAGE_BAGEL_REF_PYTHON") or (
        str(REFERENCE_PYTHON) if REFERENCE_PYTHON.is_file() else sys.executable)


def run_reference(root: Path, cfg: BagelBenchConfig) -> dict:
    """The upstream side (module docstring, 1.): its raw timings; the folder is root/ckpt."""
    (root / "job.json").write_text(json.dumps({
        "upstream": cfg.upstream, "fixtures_script": str(FIXTURES_SCRIPT), "prompt": PROMPT,
        "size": list(cfg.size), "steps": cfg.steps, "images": cfg.images, "seed": cfg.seed,
        "guidance_scale": cfg.guidance_scale, "timestep_shift": cfg.timestep_shift,
        "cfg_interval": list(cfg.cfg_interval)}))
    python = reference_python()
    done = subprocess.run([python, str(REFERENCE_SCRIPT), str(root)], capture_output=True,
                          text=True, timeout=REFERENCE_TIMEOUT_S, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise RuntimeError(f"the BAGEL reference ({python}) failed (exit {done.returncode}): "
                           f"{done.stderr.strip().splitlines()[-1:]}")
    return json.loads((root / "reference.json").read_text())


def run_ours(folder: Path, cfg: BagelBenchConfig, device: torch.device
             ) -> tuple[dict, torch.Tensor]:
    """Ours (module docstring, 2.): timings, and the warm-up's image."""
    model, vae = Bagel.from_pretrained(folder, device, torch.float32)
    pipe = BagelPipeline(model, vae, ByteTokens(), device)
    pipe.configure(BagelOptions(cfg_img_scale=1.0, cfg_interval=cfg.cfg_interval,
                                timestep_shift=cfg.timestep_shift))
    engine = DiffusionEngine(pipe)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    image_s, step_s, first = [], [], None
    for i in range(1 + cfg.images):
        params = DiffusionParams(height=cfg.size[0], width=cfg.size[1], seed=cfg.seed + i,
                                 num_inference_steps=cfg.steps,
                                 guidance_scale=cfg.guidance_scale)
        t0, stamps = now(device), []
        engine.add_request(f"image-{i}", PROMPT, params)
        while engine.has_unfinished_requests:
            (result,) = engine.step()
            assert result.error is None, result.error
            stamps.append(now(device))
        image_s.append(stamps[-1] - t0)
        step_s.append([b - a for a, b in zip(stamps[:-2], stamps[1:-1])])
        first = result.images[0] if first is None else first
    out = {"image_s": image_s, "step_s": step_s,
           "peak_memory_bytes": (torch.cuda.max_memory_allocated(device)
                                 if device.type == "cuda" else None),
           "num_parameters": sum(p.numel() for p in model.parameters())}
    del pipe, engine, model, vae
    free_device_memory(device)
    return out, first.cpu()


def summarize(raw: dict) -> dict:
    """Per image and per step: the timed runs' medians (the warm-up's kept apart)."""
    steps = [s for run in raw["step_s"][1:] for s in run]
    return {**raw, "warmup_image_s": raw["image_s"][0], "per_image_s": median(raw["image_s"][1:]),
            "per_step_s": median(steps)}


def run(cfg: BagelBenchConfig) -> dict[str, object]:
    device = resolve_device(cfg.device)
    with tempfile.TemporaryDirectory(prefix="bagel-bench-") as tmp:
        root = Path(tmp)
        raw = run_reference(root, cfg)
        ref_image = torch.tensor(raw.pop("image"), dtype=torch.uint8)
        ref = summarize(raw)
        ours, image = run_ours(root / "ckpt", cfg, device)
        ours = summarize(ours)
    return {
        "benchmark": "bagel", **environment(device), "dtype": "float32",
        "config": asdict(cfg), "shape": {"model": "tiny" if cfg.tiny else "?",
                                         "size": list(cfg.size), "steps": cfg.steps},
        "reference": ref, "ours": ours,
        "ratios": {
            "bagel_speedup_vs_reference": ratio(ref["per_image_s"], ours["per_image_s"]),
            "bagel_step_speedup_vs_reference": ratio(ref["per_step_s"], ours["per_step_s"])},
        "max_abs_diff": {"image": float((image.int() - ref_image.int()).abs().max())},
        "peak_memory_bytes": {"reference": ref["peak_memory_bytes"],
                              "ours": ours["peak_memory_bytes"]},
        "notes": "one image at a time, both sides, on the same random weights (the reference "
                 "draws them, ours loads its saved folder), the reference on the CPU in its own "
                 "interpreter. Speed-ups: the reference's seconds over ours (above 1: ours "
                 "faster), medians of the timed images and of their steps. max_abs_diff: the "
                 "warm-up image (same seed), uint8 pixels.",
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the fixtures' model (the only "
                        "shape the reference builds here)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--images", type=int, default=2, help="timed images after a warm-up")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--upstream", default=str(UPSTREAM), help="the upstream checkout")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.tiny:
        parser.error("--tiny: the reference builds the fixtures' shape only (module docstring)")
    result = run(BagelBenchConfig(steps=args.steps, images=args.images, device=args.device,
                                  upstream=args.upstream))
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text, file=sys.stdout)
    return result


if __name__ == "__main__":
    main()
