"""The INT8 W8A8 matmul of layers/triton_int8.py against bf16, FP8 and torch._int_mm at a
diffusion transformer's shapes (Qwen-Image: M = 4096 / 8192 image tokens, (N, K) its attention
and MLP projections), on the GPU: the numbers behind `triton_int8.config` (issue 44).

    python -m omnistage.benchmarks.kernels.int8_gemm --out /tmp/int8_gemm.json [--sweep]

Per shape, milliseconds a call (median of CUDA-event timings of single calls after warm-up),
each path from the bf16 activation x (M, K) to the bf16 output (M, N), bias included:

    bf16           F.linear(x, W, b)
    fp8            layers/fp8.py's Fp8Linear (Triton row quantization, torch._scaled_mm
                   rowwise with the bias in its epilogue)
    int_mm_eager   layers/int8.py's PyTorch row quantization, torch._int_mm(xq, Wq.t()) (the
                   (N, K) weight as a column-major view), the eager float32 epilogue
    triton         triton_int8.quantize_rows_int8 + int8_matmul (default config)

and the default tiles through the TMA kernel (cfg TMA=1, sm_90+) for the matmul alone,
for the two INT8 paths the quantization and the matmul alone, the speedups over bf16, and
the Triton output's largest difference from the eager INT8 one (both round the same products).
`--sweep` times int8_matmul over a grid of tile configs per shape and reports the best.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.benchmarks.common import environment
from omnistage.layers import int8, triton_int8
from omnistage.layers.fp8 import Fp8Linear

ROWS = (4096, 8192)
SHAPES = ((3072, 3072), (12288, 3072), (3072, 12288))     # (N, K)
PATHS = ("bf16", "fp8", "int_mm_eager", "triton")           # whole paths, x to y
SMEM_BYTES = 227 * 1024                                    # an H100 / H200 block's most


def time_ms(fn: Callable[[], object], reps: int = 30, warmup: int = 5) -> float:
    """Median device time of one call of fn (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def eager_int8(xq: Tensor, sx: Tensor, wq: Tensor, sw: Tensor, bias: Tensor) -> Tensor:
    """torch._int_mm on the column-major view of Wq (N, K), then int8.py's epilogue."""
    return (torch._int_mm(xq, wq.t()).float() * sx * sw + bias).to(torch.bfloat16)


def measure(m: int, n: int, k: int) -> dict[str, object]:
    """One shape: each path's ms, speedups over bf16, the Triton path's agreement."""
    lin = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wq, sw = int8.quantize_rows_int8(lin.weight.detach())            # (N, K) int8, (N, 1)
    sw = sw.view(1, n)
    bias = lin.bias.detach().float()
    fp8 = Fp8Linear.from_linear(lin)
    xq, sx = int8.quantize_rows_int8(x)
    ms = {
        "bf16": time_ms(lambda: F.linear(x, lin.weight, lin.bias)),
        "fp8": time_ms(lambda: fp8(x)),
        "int_mm_eager": time_ms(lambda: eager_int8(*int8.quantize_rows_int8(x), wq, sw, bias)),
        "int_mm_eager_quantize": time_ms(lambda: int8.quantize_rows_int8(x)),
        "int_mm_eager_matmul": time_ms(lambda: eager_int8(xq, sx, wq, sw, bias)),
        "triton": time_ms(lambda: triton_int8.int8_matmul(
            *triton_int8.quantize_rows_int8(x), wq, sw, bias)),
        "triton_quantize": time_ms(lambda: triton_int8.quantize_rows_int8(x)),
        "triton_matmul": time_ms(lambda: triton_int8.int8_matmul(xq, sx, wq, sw, bias)),
    }
    if torch.cuda.get_device_capability() >= (9, 0):                 # TMA: Hopper or newer
        ms["triton_tma_matmul"] = time_ms(lambda: triton_int8.int8_matmul(
            xq, sx, wq, sw, bias, cfg={**triton_int8.config(m, n, k), "TMA": 1}))
    tq, tsx = triton_int8.quantize_rows_int8(x)
    got = triton_int8.int8_matmul(tq, tsx, wq, sw, bias).float()
    want = eager_int8(xq, sx, wq, sw, bias).float()
    return {"m": m, "n": n, "k": k, "config": triton_int8.config(m, n, k), "ms": ms,
            "speedup_vs_bf16": {name: ms["bf16"] / ms[name] for name in PATHS},
            "quantize_equal": bool(torch.equal(tq, xq) and torch.equal(tsx, sx)),
            "max_rel_diff_vs_eager": ((got - want).abs().max() / want.abs().max()).item()}


def sweep_grid() -> list[dict[str, int]]:
    """Tile configs that fit an H100 / H200 block (shared memory for the pipeline's stages,
    at most 128 int32 accumulators a thread), each with pointer loads and with TMA."""
    grid = []
    for bm, bn, bk, warps, stages, tma in itertools.product(
            (64, 128, 256), (128, 256), (64, 128, 256), (4, 8), (3, 4, 5), (0, 1)):
        if stages * (bm + bn) * bk > SMEM_BYTES or bm * bn > 128 * 32 * warps:
            continue
        grid.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps,
                         num_stages=stages, TMA=tma))
    return grid


def sweep(m: int, n: int, k: int, grid: list[dict[str, int]]) -> dict[str, object]:
    """int8_matmul over the grid at one shape: every config's ms (or its error), the best."""
    xq = torch.randint(-127, 128, (m, k), device="cuda", dtype=torch.int8)
    wq = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
    sx = torch.rand(m, 1, device="cuda") / 127
    sw = torch.rand(1, n, device="cuda") / 127
    bias = torch.randn(n, device="cuda")
    want = triton_int8.int8_matmul(xq, sx, wq, sw, bias)
    rows = []
    for cfg in grid:
        try:
            got = triton_int8.int8_matmul(xq, sx, wq, sw, bias, cfg=cfg)
            torch.testing.assert_close(got, want, atol=0, rtol=1e-2)
            rows.append({**cfg, "ms": time_ms(
                lambda c=cfg: triton_int8.int8_matmul(xq, sx, wq, sw, bias, cfg=c), reps=10)})
        except Exception as exc:  # a config that does not build, fit or agree: noted, skipped
            rows.append({**cfg, "error": str(exc)[:200]})
    timed = [r for r in rows if "ms" in r]
    best = min(timed, key=lambda r: r["ms"]) if timed else None
    return {"m": m, "n": n, "k": k, "best": best, "configs": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--sweep", action="store_true", help="also sweep int8_matmul's tiles")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("int8_gemm: needs a CUDA GPU (it times GPU kernels); none is visible")
    torch.manual_seed(0)
    shapes = [(m, n, k) for m in args.rows for n, k in SHAPES]
    result: dict[str, object] = {**environment(torch.device("cuda")),
                                 "shapes": [measure(*s) for s in shapes]}
    if args.sweep:
        grid = sweep_grid()
        result["sweep"] = [sweep(*s, grid) for s in shapes]
    text = json.dumps(result, indent=1)
    print(text if not args.sweep else json.dumps(result["shapes"], indent=1))
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
