"""Device time of a DiT's attention at Qwen-Image's 1024x1024 shape (B=1, H=24, S = 4096 image
+ `--text-len` caption tokens, D=128; other shapes by flag): bf16 SDPA (flash, and cuDNN where
the build has it) against the FP8 attention of layers/fp8_attention.py, whole (quantization of
Q and K + kernel, what a DiT calls) and kernel alone, at each tile configuration of `--tiles`
(one GPU run sweeps BLOCK_M, BLOCK_N, num_warps, num_stages). Each variant is one call
captured in a CUDA graph and replayed (benchmarks/common.graph_time_us); accuracy against
float32 SDPA of the same inputs (cosine, relative L2, max error) beside the time.

    python -m omnistage.benchmarks.kernels.fp8_attention --out /tmp/fp8_attention.json
    python -m omnistage.benchmarks.kernels.fp8_attention --tiles "128,128,8,3;128,64,4,4"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# BLOCK_M,BLOCK_N,NUM_WARPS,NUM_STAGES;... : starting points for Hopper, D=128
DEFAULT_TILES = ("128,64,8,3;128,64,4,3;128,128,8,3;128,128,8,2;128,32,4,4;64,64,4,3;"
                 "64,128,4,3;128,64,8,4")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--image-tokens", type=int, default=4096, help="(1024 / 16)^2 at 1024 px")
    ap.add_argument("--text-len", type=int, default=64)
    ap.add_argument("--tiles", default=DEFAULT_TILES,
                    help="BLOCK_M,BLOCK_N,NUM_WARPS,NUM_STAGES;... of the fp8 kernel")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", type=Path)
    return ap


def accuracy(out: Tensor, exact: Tensor) -> dict[str, float]:
    """out against float32 attention: cosine, relative L2 error, largest error."""
    a, b = out.float().flatten(), exact.flatten()
    return {"cosine": float(F.cosine_similarity(a, b, dim=0)),
            "rel_l2": float((a - b).norm() / b.norm()), "max_abs": float((a - b).abs().max())}


def _sdpa_variants(q: Tensor, k: Tensor, v: Tensor) -> dict[str, Callable[[], Tensor]]:
    """bf16 SDPA pinned to each fused backend this build has."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    variants = {}
    for name, backend in (("sdpa_flash_bf16", SDPBackend.FLASH_ATTENTION),
                          ("sdpa_cudnn_bf16", SDPBackend.CUDNN_ATTENTION)):
        def call(backend: SDPBackend = backend) -> Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)
        variants[name] = call
    return variants


def _fp8_variants(q: Tensor, k: Tensor, v: Tensor, tiles: list[str]
                  ) -> dict[str, Callable[[], Tensor]]:
    """Per tile configuration: quantization + kernel, and the kernel on quantized inputs."""
    from omnistage.layers import fp8_attention as fa

    q8, qs, k8, ks = fa.quantize_qk(q, k)
    scale = q.shape[-1] ** -0.5
    variants: dict[str, Callable[[], Tensor]] = {
        "fp8_quantize_only": lambda: fa.quantize_qk(q, k)[0]}
    for text in tiles:
        t = fa.Tiles.parse(text)
        variants[f"fp8_whole {text}"] = lambda t=t: fa.fp8_attention(q, k, v, tiles=t)
        variants[f"fp8_kernel {text}"] = lambda t=t: fa.launch(q8, qs, k8, ks, v, None, scale, t)
    return variants


def main() -> None:
    from omnistage.benchmarks.common import graph_time_us

    args = _parser().parse_args()
    b, h, d = args.batch, args.heads, args.head_dim
    s = args.image_tokens + args.text_len
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device=dev, generator=gen, dtype=torch.bfloat16)
               for _ in range(3))
    with torch.no_grad():
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    flops = 4 * b * h * s * s * d
    tiles = [t for t in args.tiles.split(";") if t]
    rows = []
    variants = {**_sdpa_variants(q, k, v), **_fp8_variants(q, k, v, tiles)}
    for name, fn in variants.items():
        row: dict[str, object] = {"variant": name}
        try:
            with torch.no_grad():
                out = fn()
                row["us"] = graph_time_us(fn, args.iters)
            if name != "fp8_quantize_only":
                row["tflops"] = flops / row["us"] / 1e6
                row.update(accuracy(out, exact))
        except Exception as exc:        # a tile that does not fit, a backend not built
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(json.dumps(row))
        rows.append(row)
    timed = [r for r in rows if "us" in r and str(r["variant"]).startswith("fp8_whole")]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    flash = next((r for r in rows if r["variant"] == "sdpa_flash_bf16" and "us" in r), None)
    summary = {"best_fp8": best, "fp8_speedup_vs_sdpa_flash":
               flash["us"] / best["us"] if best and flash else None}
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps({
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "shape": {"batch": b, "heads": h, "seq": s, "head_dim": d}, "rows": rows,
            **summary}, indent=1))


if __name__ == "__main__":
    main()
