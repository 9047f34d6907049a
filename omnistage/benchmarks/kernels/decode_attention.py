"""Device time of one decode step's attention for a single stream (Qwen3-0.6B's attention
shapes, bf16, random weights and cache): the separate kernels (q/k norm + rotary + K/V store,
split-K attention, combine) against the one-kernel version (triton_decode_attention.py) at
several tile sizes and warp counts. Each variant is captured as a CUDA graph of `--calls`
back-to-back calls (like a step's layers, with programmatic dependent launch unless --no-pdl)
and replayed; reported per call.

    python -m omnistage.benchmarks.kernels.decode_attention --out /tmp/decode_attention.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="256,512")
    ap.add_argument("--calls", type=int, default=28)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--configs", default="4,32;4,16;8,32;4,64",
                    help="NUM_WARPS,BLOCK_T;... of the one-kernel version")
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--out", type=Path)
    return ap


def main() -> None:
    from omnistage.benchmarks.common import graph_time_us
    from omnistage.layers import fused, pdl
    from omnistage.layers import triton_decode_attention as tda
    from omnistage.layers.attention import Attention, forward_context
    from omnistage.layers.norm import RMSNorm
    from omnistage.layers.rotary import get_rope
    from omnistage.layers.triton_attention import TritonPagedAttention
    from omnistage.testing.attention import mixed_batch_metadata

    args = _parser().parse_args()
    pdl.set_enabled(not args.no_pdl)

    H, HKV, D, PAGE = 16, 8, 128, 16
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    attn = Attention(H, D, HKV)
    rope = get_rope(D, 4096, {"rope_type": "default", "rope_theta": 1e6}).to(dev)
    q_norm, k_norm = RMSNorm(D).to(dev, dt), RMSNorm(D).to(dev, dt)
    rows = []
    for ctx in map(int, args.contexts.split(",")):
        blocks = -(-(ctx + 1) // PAGE)
        attn.k_cache = torch.randn(blocks + 1, PAGE, HKV, D, device=dev, dtype=dt)
        attn.v_cache = torch.randn_like(attn.k_cache)
        table = list(range(blocks))
        md = mixed_batch_metadata([(ctx, 1)], [table], [ctx], dev)
        md.max_seq_len = max(md.max_seq_len, 4096)   # as a CUDA graph plans: 16 slices
        qkv = torch.randn(1, (H + 2 * HKV) * D, device=dev, dtype=dt)
        q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
        q, k, v = q.view(1, H, D), k.view(1, HKV, D), v.view(1, HKV, D)
        positions = torch.tensor([ctx], device=dev)

        def timed(tag: str) -> None:
            attn.backend = TritonPagedAttention(PAGE, H // HKV, HKV)
            attn.backend.prepare(md, has_cache=True)

            def calls():
                with forward_context(md):
                    for _ in range(args.calls):
                        attn.rotate_and_attend(rope, positions, q, k, v, q_norm, k_norm)
            us = graph_time_us(calls, args.iters) / args.calls
            row = {"variant": tag, "context": ctx, "us_per_call": us,
                   "splits": attn.backend._plan(md, H // HKV).launches[0].num_splits}
            print(json.dumps(row))
            rows.append(row)

        fused.set_decode_attention(False)
        timed("three kernels")
        fused.set_decode_attention(True)
        for c in filter(None, args.configs.split(";")):
            tda.NUM_WARPS, block_t = map(int, c.split(","))
            tda.BLOCK_T = block_t
            timed(f"one kernel, NUM_WARPS,BLOCK_T={c}")
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "pdl": not args.no_pdl,
                                        "calls": args.calls, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
