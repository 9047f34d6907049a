"""Layerwise offload's step time against the resident transformer (issue 44: target <= 1.5x):
Qwen-Image's transformer at its released width (`--layers` of its 60 blocks: the ratio is a
block's, so fewer blocks measure it in less time and host memory), 1024x1024, bf16, the same
Euler loop both ways on the same weights; offloaded with 1 and 2 blocks fetched ahead
(diffusion/offload.py). Also the host-to-device copy rate it is bound by, the device memory
the blocks keep, and that the latents are the same.

    python -m omnistage.benchmarks.offload --out benchmarks/results/offload_h200.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from omnistage.benchmarks.common import environment, seeded_init
from omnistage.benchmarks.diffusion import QWEN_IMAGE, DiffusionBenchConfig, denoiser_inputs
from omnistage.diffusion.offload import BlockOffload


def copy_rate(device: torch.device, gib: float = 2.0) -> float:
    """GB/s of one pinned host -> device copy of `gib` GiB."""
    host = torch.empty(int(gib * 2**30), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return host.numel() / (time.perf_counter() - start) / 1e9


def run(layers: int, steps: int, size: int, prefetches: tuple[int, ...]) -> dict[str, object]:
    from omnistage.models.qwen_image_transformer import (QwenImageTransformer2DModel,
                                                         QwenImageTransformerConfig)

    device, dtype = torch.device("cuda"), torch.bfloat16
    arch = {**QWEN_IMAGE, "num_layers": layers}
    cfg = DiffusionBenchConfig(size=size, steps=steps, num_layers=layers)
    _, text, timed = denoiser_inputs(cfg, device, dtype)
    grid = size // 16
    with torch.device("cpu"):
        host_model = QwenImageTransformer2DModel(QwenImageTransformerConfig.from_dict(arch))
    host_model = host_model.to(dtype).eval()
    seeded_init(host_model, 0)
    out: dict[str, object] = {"layers": layers, "steps": steps, "size": size,
                              "host_to_device_gb_s": round(copy_rate(device), 1)}

    def forward(model: torch.nn.Module):  # -> the timed loop's forward
        return lambda x, t: model(x, text, None, t, img_shapes=[[(1, grid, grid)]])

    resident = copy.deepcopy(host_model).to(device)
    want, out["resident_s"] = timed(forward(resident))
    out["resident_gib"] = round(torch.cuda.memory_allocated(device) / 2**30, 2)
    del resident
    torch.cuda.empty_cache()
    for prefetch in prefetches:
        model = copy.deepcopy(host_model)
        offload = BlockOffload(model, device, prefetch)
        got, seconds = timed(forward(model))
        out[f"offload{prefetch}_s"] = seconds
        out[f"offload{prefetch}_over_resident"] = round(seconds / out["resident_s"], 3)
        out[f"offload{prefetch}_blocks_gib_on_device"] = round(offload.resident_bytes / 2**30, 2)
        out[f"offload{prefetch}_max_abs_diff"] = float((got.float() - want.float()).abs().max())
        del model, offload
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {"benchmark": "offload", "model": "qwen-image", **environment(torch.device("cuda")),
              **run(args.layers, args.steps, args.size, (1, 2))}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
