"""Tile sizes of the matrix-vector kernels (omnistage/layers/triton_gemv.py) against cuBLAS on
the decode matmuls of a real shape, on the GPU: the numbers behind `triton_gemv.config`.

    python -m omnistage.benchmarks.kernels.sweep_gemv --out /tmp/sweep_gemv.json

Each measurement is one CUDA graph of `--layers` calls, each on its own copy of the weight (as
a decode step walks its layers, so the weights come from memory, not L2), replayed and timed
with CUDA events; the result is microseconds per call and the bandwidth that means. Baselines:
cuBLAS alone (F.linear) and the unfused pair a decode step runs without the kernels
(RMSNorm with its residual add, or SiLU-and-mul, then F.linear).

`--weight-dtype fp8 | int8`: the kernels' W8A16 path instead (bytes and bandwidth at
one byte a weight; cuBLAS still in bf16, the baseline): FP8 or INT8 (N, K), as Fp8Linear and
Int8Linear keep them.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from omnistage.layers import triton_gemv, triton_ops

# Qwen3-0.6B's decode matmuls: (name, N, K, what runs in front)
SHAPES = {
    "qwen3-0.6b": [("qkv", 4096, 1024, "norm"), ("o", 1024, 2048, "plain"),
                   ("gate_up", 6144, 1024, "norm"), ("down", 1024, 3072, "silu")],
    "qwen3-1.7b": [("qkv", 4096, 2048, "norm"), ("o", 2048, 2048, "plain"),
                   ("gate_up", 12288, 2048, "norm"), ("down", 2048, 6144, "silu")],
}


def time_graph(fn, reps: int = 20) -> float:
    """Seconds per replay of a CUDA graph of fn()."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--block-n", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--block-k", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--num-stages", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--weight-dtype", default="bf16", choices=("bf16", "fp8", "int8"))
    ap.add_argument("--packed", type=int, nargs="+", choices=(0, 1),
                    help="INT8 weights at one row: read four a word (1) or one a lane (0), "
                         "each tried (default: triton_gemv.packing's choice)")
    ap.add_argument("--out", type=Path)
    return ap


def eight_bit(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A bf16 weight (N, K) as the kernels read it in `kind` (module docstring), and its
    per-output-channel scale (None for bf16)."""
    if kind == "bf16":
        return w, None
    if kind == "fp8":
        scale = w.abs().amax(dim=1).float().clamp(min=1e-12) / 448.0
        return (w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale
    scale = w.abs().amax(dim=1).float().clamp(min=1e-12) / 127.0
    q = (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def _time_configs(grid: list[dict], x: torch.Tensor, res: torch.Tensor, norm_w: torch.Tensor,
                  weights: list[tuple[torch.Tensor, torch.Tensor | None]], front: str, k: int,
                  gbytes: float
                  ) -> list[dict]:
    """Each tile config of the grid on one shape: microseconds a call and TB/s, or the error
    of a config that does not build or fit (its output checked against the first's)."""
    def launch(w: tuple[torch.Tensor, torch.Tensor | None], cfg: dict) -> torch.Tensor:
        return triton_gemv._launch(x, res if front == "norm" else None,
                                   norm_w if front == "norm" else None, 1e-6, w[0], None,
                                   front == "silu", k, dict(cfg), scale=w[1])[0]

    def ours(cfg: dict):  # type: ignore[no-untyped-def]
        def run() -> None:
            for w in weights:
                launch(w, cfg)
        return run

    want = launch(weights[0], grid[0])
    out = []
    for cfg in grid:
        try:
            torch.testing.assert_close(launch(weights[0], cfg), want, atol=2e-2, rtol=2e-2)
            us = time_graph(ours(cfg)) / len(weights) * 1e6
        except Exception as exc:  # a config that does not build or fit: skip it
            out.append({**cfg, "error": str(exc)[:200]})
            continue
        out.append({**cfg, "us": us, "tb_s": gbytes / us * 1e6 / 1e3})
    return out


def main() -> None:
    args = _parser().parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    grid = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
            for bn, bk, nw, ns in itertools.product(args.block_n, args.block_k, args.num_warps,
                                                    args.num_stages)]
    if args.packed is not None:        # INT8 weights: four a word or one a lane, both
        grid = [{**cfg, "PACKED": p} for cfg in grid for p in args.packed]
    results = []
    for name, n, k, front in SHAPES[args.preset]:
        weights = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(args.layers)]
        norm_w = torch.ones(k, device=dev, dtype=dt)
        ours = [eight_bit(w, args.weight_dtype) for w in weights]
        gbytes = n * k * ours[0][0].element_size() / 1e9
        for rows in args.rows:
            x = torch.randn(rows, 2 * k if front == "silu" else k, device=dev, dtype=dt)
            res = torch.randn(rows, k, device=dev, dtype=dt)

            def unfused() -> None:
                for w in weights:
                    if front == "norm":
                        h, _ = triton_ops.add_rms_norm(x, res, norm_w, 1e-6)
                    elif front == "silu":
                        h = triton_ops.silu_and_mul(x)
                    else:
                        h = x
                    F.linear(h, w)

            def cublas() -> None:
                for w in weights:
                    F.linear(x[:, :k], w)

            row = {"name": name, "n": n, "k": k, "front": front, "rows": rows,
                   "cublas_us": time_graph(cublas) / args.layers * 1e6,
                   "unfused_us": time_graph(unfused) / args.layers * 1e6,
                   "default": triton_gemv.config(n, k, rows),
                   "configs": _time_configs(grid, x, res, norm_w, ours, front, k, gbytes)}
            results.append(_summarize(row, grid))
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                        "torch": torch.__version__, "preset": args.preset,
                                        "weight_dtype": args.weight_dtype,
                                        "results": results}, indent=1))


def _summarize(row: dict, grid: list[dict]) -> dict:
    """The row with its best config and the default's time, printed with the five best."""
    ok = sorted((c for c in row["configs"] if "us" in c), key=lambda c: c["us"])
    row["best"] = ok[0] if ok else None
    row["default_us"] = next((c["us"] for c in ok if all(
        c[key] == v for key, v in row["default"].items())), None)
    best = row["best"] or {}
    print(f"{row['name']:8s} rows {row['rows']}: cuBLAS {row['cublas_us']:6.2f} us, unfused "
          f"{row['unfused_us']:6.2f} us, default {row['default_us'] or 0:6.2f} us, best "
          f"{best.get('us', 0):6.2f} us ({best.get('tb_s', 0):.2f} TB/s) "
          f"{ {key: best.get(key) for key in grid[0]} }", flush=True)
    for c in ok[:5]:
        print("    ", {key: c[key] for key in grid[0]}, f"{c['us']:.2f} us")
    return row


if __name__ == "__main__":
    main()
