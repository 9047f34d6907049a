"""The 4-bit (W4A16) matrix-vector kernels on the decode matmuls of Qwen3-0.6B / 1.7B / 8B at 1,
2 and 4 rows, on the GPU (issue 44): the first kernel (layers/triton_int4.py, "rows"), the
split-K kernel (layers/triton_int4_split.py) over a grid of tiles and at its default tiles,
against bf16 through cuBLAS (F.linear) and through our one-row kernel (layers/triton_gemv.py).

    python -m omnistage.benchmarks.kernels.int4_sweep --out /tmp/int4_sweep.json

Each time is one CUDA graph of calls over copies of the weight (more bytes than L2 holds, so
the weights come from memory, as a decode step's layers do; benchmarks/kernels/sweep_gemv.py's
`time_graph`, CUDA events), in microseconds a call, with the bandwidth its weight bytes mean.
Every split config is first checked against the float32 matmul of the dequantized weight. The
JSON's "tiles" holds, per (N, K, rows), the split config fastest there, the form
`triton_int4_split.load_tiles` reads (ar_offline --int4-tiles FILE) and `TILES` takes.
Rows are swept in order (1 first); past --budget-s a shape gets its baselines and the default
tiles only, so the run stays within about three minutes on an H200.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from omnistage.benchmarks.kernels.sweep_gemv import time_graph
from omnistage.layers import triton_gemv, triton_int4, triton_int4_split
from omnistage.layers.int4 import GROUP_SIZE, dequantize_int4, quantize_int4

# (name, N, K) of each decoder layer's matmuls: qkv (q + k + v heads x 128), o, gate_up, down
SHAPES = {
    "qwen3-0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024),
                   ("down", 1024, 3072)],
    "qwen3-1.7b": [("qkv", 4096, 2048), ("o", 2048, 2048), ("gate_up", 12288, 2048),
                   ("down", 2048, 6144)],
    "qwen3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096),
                 ("down", 4096, 12288)],
}
DEVICE = "cuda"
COPY_BYTES = 160e6         # each timed graph reads at least this much weight (H200's L2: 50 MB)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--block-k", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--split-k", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4, 8],
                    help="8 warps only for BLOCK_N >= 64 (fewer outputs: too little a thread)")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="after this many seconds, only baselines and default tiles")
    ap.add_argument("--out", type=Path)
    return ap


def _grid(args: argparse.Namespace, k: int, rows: int) -> list[dict[str, int]]:
    """The tile configs worth timing at K: no tile wider than K, no more splits than tiles,
    no more than 32 / rows words a thread: more spill registers on sm_90 (ptxas)."""
    grid = []
    for bn, bk, split, nw in itertools.product(args.block_n, args.block_k, args.split_k,
                                               args.num_warps):
        words = bn * bk // 8 // (32 * nw)
        if (bk <= max(GROUP_SIZE, triton.next_power_of_2(k)) and split <= -(-k // bk)
                and (nw <= 4 or bn >= 64) and words <= 32 // rows):
            grid.append(dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=nw,
                             num_stages=1))
    return grid


class Shape:
    """One matmul's weights: int4 (packed, scales) and bf16, each in enough copies."""

    def __init__(self, n: int, k: int) -> None:
        dev = torch.device(DEVICE)
        self.n, self.k = n, k
        weight = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        packed, scale = quantize_int4(weight, GROUP_SIZE, torch.bfloat16)
        self.int4_bytes = packed.numel() * 4 + scale.numel() * 2
        self.bf16_bytes = n * k * 2
        self.int4 = [(packed.clone(), scale.clone())
                     for _ in range(_copies(self.int4_bytes))]
        self.bf16 = [weight.clone() for _ in range(_copies(self.bf16_bytes))]
        self.dequantized = dequantize_int4(packed, scale.float(), k, GROUP_SIZE)

    def time_int4(self, fn) -> float:  # type: ignore[no-untyped-def]
        """Microseconds a call of fn(packed, scale) over the copies."""
        return time_graph(lambda: [fn(p, s) for p, s in self.int4]) / len(self.int4) * 1e6

    def time_bf16(self, fn) -> float:  # type: ignore[no-untyped-def]
        return time_graph(lambda: [fn(w) for w in self.bf16]) / len(self.bf16) * 1e6


def _copies(nbytes: int) -> int:
    return max(2, min(28, -(-int(COPY_BYTES) // nbytes)))


def _rows_kernel(x: torch.Tensor):  # type: ignore[no-untyped-def]
    def run(p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        triton_int4.set_kernel("rows")
        try:
            return triton_int4.linear(x, p, s, GROUP_SIZE)
        finally:
            triton_int4.set_kernel(None)
    return run


def _split_kernel(x: torch.Tensor, cfg: dict[str, int] | None):  # type: ignore[no-untyped-def]
    return lambda p, s: triton_int4_split.linear(x, p, s, GROUP_SIZE, None, cfg)


def _time_split(shape: Shape, x: torch.Tensor, want: torch.Tensor,
                cfg: dict[str, int] | None) -> dict:
    """One split config: checked against `want` (the dequantized matmul), then timed; its
    error if it does not build, fit or agree."""
    entry = dict(cfg or triton_int4_split.config(shape.n, shape.k, GROUP_SIZE, x.shape[0]))
    try:
        got = _split_kernel(x, cfg)(*shape.int4[0]).float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
        us = shape.time_int4(_split_kernel(x, cfg))
    except Exception as exc:  # a config that does not build, fit or agree: recorded, skipped
        return {**entry, "error": str(exc)[:300]}
    return {**entry, "us": us, "tb_s": shape.int4_bytes / us / 1e6}


def _measure(shape: Shape, rows: int, grid: list[dict[str, int]]) -> dict:
    """Baselines, the first int4 kernel, the split kernel's default and its grid at `rows`."""
    x = torch.randn(rows, shape.k, device=DEVICE, dtype=torch.bfloat16)
    row: dict = {"n": shape.n, "k": shape.k, "rows": rows,
                 "int4_bytes": shape.int4_bytes, "bf16_bytes": shape.bf16_bytes,
                 "bf16_cublas_us": shape.time_bf16(lambda w: F.linear(x, w))}
    if triton_gemv.applies(x, shape.bf16[0], rows=1):     # our bf16 kernels: one row only
        row["bf16_gemv_us"] = shape.time_bf16(lambda w: triton_gemv.linear(x, w))
    row["int4_rows_us"] = shape.time_int4(_rows_kernel(x))
    want = F.linear(x.float(), shape.dequantized)
    row["split_default"] = _time_split(shape, x, want, None)
    row["configs"] = [_time_split(shape, x, want, cfg) for cfg in grid]
    ok = sorted((c for c in row["configs"] + [row["split_default"]] if "us" in c),
                key=lambda c: c["us"])
    row["best"] = ok[0] if ok else None
    return row


def _print(row: dict) -> None:
    best = row["best"] or {}
    gemv = row.get("bf16_gemv_us")
    print(f"{row['preset']:11s} {row['name']:8s} {row['n']:6d}x{row['k']:<6d} rows {row['rows']}:"
          f" bf16 cuBLAS {row['bf16_cublas_us']:7.2f}"
          f"{f' gemv {gemv:7.2f}' if gemv else ''} | int4 rows {row['int4_rows_us']:7.2f}"
          f" split default {row['split_default'].get('us', float('nan')):7.2f} best "
          f"{best.get('us', float('nan')):7.2f} us ({best.get('tb_s', 0):.2f} TB/s) "
          f"{ {key: best.get(key) for key in triton_int4_split.TILE_KEYS} }", flush=True)


def tiles_from(results: list[dict]) -> list[dict]:
    """Per (N, K, rows): the fastest config (of the grid and the default tiles)."""
    return [{"n": row["n"], "k": row["k"], "rows": row["rows"],
             **{name: row["best"][name] for name in triton_int4_split.TILE_KEYS}}
            for row in results if row["best"] is not None]


def layer_sums(results: list[dict]) -> list[dict]:
    """Per preset and rows: one decoder layer's four matmuls, microseconds summed, each way."""
    sums: dict[tuple[str, int], dict] = {}
    for row in results:
        total = sums.setdefault((row["preset"], row["rows"]), {
            "preset": row["preset"], "rows": row["rows"], "bf16_cublas_us": 0.0,
            "bf16_gemv_us": 0.0, "int4_rows_us": 0.0, "int4_split_default_us": 0.0,
            "int4_split_best_us": 0.0})
        total["bf16_cublas_us"] += row["bf16_cublas_us"]
        total["bf16_gemv_us"] += row.get("bf16_gemv_us", float("nan"))
        total["int4_rows_us"] += row["int4_rows_us"]
        total["int4_split_default_us"] += row["split_default"].get("us", float("nan"))
        total["int4_split_best_us"] += (row["best"] or {}).get("us", float("nan"))
    return [{key: None if v != v else v for key, v in total.items()}   # NaN: not measured
            for total in sums.values()]


def main() -> None:
    args = _parser().parse_args()
    torch.manual_seed(0)
    start = time.monotonic()
    shapes = [(preset, name, Shape(n, k)) for preset in args.presets
              for name, n, k in SHAPES[preset]]
    results = []
    for rows in args.rows:
        for preset, name, shape in shapes:
            late = time.monotonic() - start > args.budget_s
            grid = [] if late else _grid(args, shape.k, rows)
            row = {"preset": preset, "name": name, **_measure(shape, rows, grid),
                   "grid_skipped": late}
            _print(row)
            results.append(row)
    out = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
           "torch": torch.__version__,
           "triton": triton.__version__, "seconds": time.monotonic() - start,
           "layers": layer_sums(results), "results": results, "tiles": tiles_from(results)}
    for line in out["layers"]:
        print(line)
    print(f"{out['seconds']:.0f} s; tiles for {len(out['tiles'])} shapes")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
