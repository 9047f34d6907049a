"""Device time of the decoder layers of a one-row decode step (Qwen3-0.6B's shapes, random
bfloat16 weights, a context of --context tokens): the one-kernel-a-layer path against the
per-op kernels (with the attention as one kernel, triton_decode_attention.py, and as the three
it replaces), each replayed from a CUDA graph in this process, and (--breakdown) the layer
kernel with parts left out (timing only: no barriers, no attention, no matmuls) to see where
its time goes. Effective bandwidth = bytes of the layers' weights / time.

    python -m omnistage.benchmarks.kernels.layer_kernel --out /tmp/layer_kernel.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from omnistage.benchmarks.ar_offline import PRESETS


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESETS))
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--configs", default="",
                    help="MAX_TILE,WARPS[,MAX_REGISTERS];... extra layer-kernel settings")
    ap.add_argument("--sweep-gemv", action="store_true",
                    help="per-op kernels: each matmul shape's tile config swept inside the whole "
                         "step (the others at their defaults), then the best of each together")
    ap.add_argument("--lm-head", action="store_true",
                    help="also the one-row lm_head: cuBLAS against the matrix-vector kernel")
    ap.add_argument("--breakdown", action="store_true",
                    help="also the layer kernel with parts left out")
    ap.add_argument("--attention-variants", action="store_true",
                    help="critical-path timelines of the one-kernel decode attention's "
                         "settings (keys a tile, warps, slices)")
    ap.add_argument("--timeline", action="store_true",
                    help="per kernel name, the time it adds to a step's critical path "
                         "(torch.profiler over graph replays), per-op kernels both PDL ways")
    ap.add_argument("--out", type=Path)
    return ap


def _random_model(preset: str, context: int):  # -> (ModelConfig, Qwen3ForCausalLM, backend, md)
    """Our Qwen3 of `preset` with random bf16 weights and caches on CUDA, and the metadata of
    one decode row after `context` tokens."""
    from transformers import Qwen3Config

    from omnistage.layers.attention import Attention, AttentionMetadata, get_attention_backend
    from omnistage.models.config import ModelConfig
    from omnistage.models.qwen3 import Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = ModelConfig.from_hf(Qwen3Config(**PRESETS[preset],
                                          architectures=["Qwen3ForCausalLM"]))
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
        if p.dim() == 1:
            p.data.add_(1.0)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    block = 16
    num_blocks = -(-(context + 1) // block) + 1
    backend = get_attention_backend("auto", torch.device("cuda"), block,
                                    cfg.num_attention_heads // cfg.num_key_value_heads,
                                    cfg.num_key_value_heads)
    for layer in layers:
        layer.backend = backend
        layer.k_cache = torch.randn(num_blocks, block, cfg.num_key_value_heads, cfg.head_dim,
                                    device="cuda", dtype=torch.bfloat16)
        layer.v_cache = torch.randn_like(layer.k_cache)
    ctx = context
    md = AttentionMetadata(
        slot_mapping=torch.tensor([ctx], device="cuda"),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([ctx + 1], dtype=torch.int32, device="cuda"),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device="cuda")[None],
        query_start_loc_cpu=[0, 1], seq_lens_cpu=[ctx + 1], max_query_len=1,
        max_seq_len=num_blocks * block)
    return cfg, model, backend, md


def _layer_kernel_variants(timed, breakdown: bool, configs: str) -> list[dict]:
    """The layer kernel with parts left out (breakdown), then with other tile settings."""
    from omnistage.layers import triton_decoder_layer as tdl

    rows = []
    real_init = tdl.DecoderStack.__init__
    for skip, tag in ((1, "no barriers"), (2, "no attention"), (3, "no barriers, no attention"),
                      (4, "no matmuls"), (5, "no matmuls, no barriers"), (6, "barriers only")):
        if not breakdown:
            break

        def init(self, *a, _skip=skip, **k):  # type: ignore[no-untyped-def]
            real_init(self, *a, **k)
            self.skip = _skip
        tdl.DecoderStack.__init__ = init
        rows.append(timed("layer kernel, " + tag))
    tdl.DecoderStack.__init__ = real_init
    for c in filter(None, configs.split(";")):
        vals = list(map(int, c.split(",")))
        tdl.MAX_TILE, tdl.NUM_WARPS = vals[:2]
        tdl.MAX_REGISTERS = vals[2] if len(vals) > 2 else None
        rows.append(timed(f"layer kernel MAX_TILE,WARPS[,MAX_REGISTERS]={c}"))
    return rows


def main() -> None:
    from omnistage.benchmarks.common import graph_time_us
    from omnistage.layers import fused
    from omnistage.layers.attention import forward_context

    args = _parser().parse_args()

    cfg, model, backend, md = _random_model(args.preset, args.context)
    ctx = args.context
    inner = model.model
    ids = torch.tensor([5], device="cuda")
    pos = torch.tensor([ctx], device="cuda")
    weight_bytes = sum(p.numel() * p.element_size() for n, p in inner.layers.named_parameters())

    def step():
        with forward_context(md):
            return inner(ids, pos)[0]

    def timed(tag: str) -> dict:
        backend.prepare(md, has_cache=True)
        inner._stack = None
        us = graph_time_us(step, args.iters, warmup=5)
        row = {"variant": tag, "us_per_step": us, "us_per_layer": us / cfg.num_hidden_layers,
               "weight_tb_s": weight_bytes / us / 1e6}
        print(json.dumps(row))
        return row

    rows = []
    fused.set_layer_kernel(False)
    if args.timeline:
        rows += timeline_rows(step, timed, backend, md, cfg)
    if args.attention_variants:
        rows += attention_rows(step, timed, backend, md, cfg)
    rows.append(timed("per-op kernels"))
    fused.set_decode_attention(not fused.decode_attention_for(torch.empty(1, 1, 1, device="cuda")))
    rows.append(timed("per-op kernels, the other attention (one kernel / three)"))
    fused.set_decode_attention(None)
    fused.set_layer_kernel(True)     # on any GPU
    rows.append(timed("layer kernel"))
    rows += _layer_kernel_variants(timed, args.breakdown, args.configs)
    if args.lm_head:
        rows += lm_head_rows(model, args.iters)
    if args.sweep_gemv:
        rows.append(sweep_gemv(timed, cfg))
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                        "preset": args.preset, "context": ctx,
                                        "weight_bytes_layers": weight_bytes, "rows": rows},
                                       indent=1))


# the one-row matmul tiles every shape took on an H100 before the early-launch sweep
OLD_TILES = dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=3)


def matmul_shapes(cfg) -> dict[str, tuple[int, int]]:  # type: ignore[no-untyped-def]
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim, h),
            "o": (h, cfg.num_attention_heads * cfg.head_dim), "gate_up": (2 * i, h),
            "down": (h, i)}


def timeline_rows(step, timed, backend, md, cfg) -> list[dict]:  # type: ignore[no-untyped-def]
    """Critical-path timelines of the per-op kernels: the defaults, and with PDL's early
    launch, the one-kernel attention or the new matmul tiles taken back one at a time, and all
    three (the kernels before)."""
    from omnistage.layers import fused, pdl, triton_gemv

    default = triton_gemv.config
    old = (lambda n, k, r: OLD_TILES if n < 32768 else default(n, k, r))
    rows = []
    for tag, early, one_kernel, tiles in (
            ("defaults", None, None, default), ("before", False, False, old),
            ("no early launch", False, None, default),
            ("attention in three kernels", None, False, default),
            ("old tiles", None, None, old), ("defaults", None, None, default)):
        if early is None:
            pdl.reset_early_launch()
        else:
            pdl.set_early_launch(early)
        fused.set_decode_attention(one_kernel)
        triton_gemv.config = tiles
        row = timed(tag)
        backend.prepare(md, has_cache=True)
        row.update(timeline(step, tag, cfg.num_hidden_layers))
        rows.append(row)
    pdl.reset_early_launch()
    fused.set_decode_attention(None)
    triton_gemv.config = default
    return rows


def attention_rows(step, timed, backend, md, cfg) -> list[dict]:  # type: ignore[no-untyped-def]
    """The one-kernel decode attention's keys a tile, warps and most slices, inside the step
    (the rest at their defaults), each timed and its critical path traced."""
    from omnistage.layers import fused
    from omnistage.layers import triton_decode_attention as tda

    saved = tda.BLOCK_T, tda.NUM_WARPS, tda.MAX_SPLITS
    fused.set_decode_attention(True)
    rows = []
    for block_t, warps, splits in ((32, 4, 8), (128, 8, 4), (128, 8, 8), (64, 8, 8), (64, 8, 4),
                                   (128, 16, 8), (64, 16, 8), saved):
        tda.BLOCK_T, tda.NUM_WARPS, tda.MAX_SPLITS = block_t, warps, splits
        tag = f"attention BLOCK_T={block_t} warps={warps} slices<={splits}"
        row = timed(tag)
        backend.prepare(md, has_cache=True)
        row.update(timeline(step, tag, cfg.num_hidden_layers))
        rows.append(row)
    tda.BLOCK_T, tda.NUM_WARPS, tda.MAX_SPLITS = saved
    fused.set_decode_attention(None)
    return rows


def timeline(step, tag: str, layers: int,  # type: ignore[no-untyped-def]
             replays: int = 20) -> dict:
    """Replays of step's CUDA graph under torch.profiler: per kernel name, its count, mean
    duration (which, with PDL, includes waiting for the kernel before it) and the time it
    adds to the step: its end minus the latest end of the kernels that started before it."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    kernels = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
                     for e in prof.profiler.kineto_results.events()
                     if e.device_type().name == "CUDA" and e.duration_ns() > 0)
    per_step = len(kernels) // replays
    per_layer = (per_step - 2) // layers      # the embedding and the final norm around them
    names: dict[str, dict] = {}
    spans = []
    for r in range(replays):
        ks = kernels[r * per_step:(r + 1) * per_step]
        latest = ks[0][0]
        spans.append((ks[-1][1] - ks[0][0]) / 1e3)
        for i, (start, end, name) in enumerate(ks):
            label = f"{(i - 1) % per_layer}: {name[:50]}" if 0 < i <= layers * per_layer \
                else name[:50]
            d = names.setdefault(label, {"count": 0, "duration_us": 0.0, "adds_us": 0.0})
            d["count"] += 1
            d["duration_us"] += (end - start) / 1e3
            d["adds_us"] += max(0, end - latest) / 1e3       # a gap before it counts as its own
            latest = max(latest, end)
    out = {"variant": tag, "kernels_per_step": per_step,
           "span_us": sorted(spans)[len(spans) // 2], "kernels": {}}
    for name, d in sorted(names.items()):
        out["kernels"][name] = {"per_step": d["count"] / replays,
                                "mean_us": d["duration_us"] / d["count"],
                                "adds_us_per_step": d["adds_us"] / replays}
    print(tag, f"span {out['span_us']:.1f} us")
    for name, k in out["kernels"].items():
        print(f"   {name:56s} x{k['per_step']:5.1f} mean {k['mean_us']:6.2f} adds "
              f"{k['adds_us_per_step'] / k['per_step']:5.2f} us each")
    return out


def lm_head_rows(model, iters: int) -> list[dict]:  # type: ignore[no-untyped-def]
    """One row through the tied lm_head: cuBLAS against triton_gemv at a few tile sizes."""
    from omnistage.benchmarks.common import graph_time_us
    from omnistage.layers import triton_gemv

    w = model.lm_head.weight
    h = torch.randn(1, w.shape[1], device=w.device, dtype=w.dtype)
    nbytes = w.numel() * w.element_size()
    variants = [("lm_head cuBLAS", lambda: model.lm_head(h)),
                ("lm_head gemv default", lambda: triton_gemv.linear(h, w))]
    for bn, bk, warps in ((8, 1024, 4), (16, 1024, 4), (16, 512, 4), (32, 512, 8)):
        c = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1)
        variants.append((f"lm_head gemv {bn},{bk},{warps}",
                         lambda c=c: triton_gemv._launch(h, None, None, 0.0, w, None, False,
                                                         w.shape[1], c)[0]))
    out = []
    for tag, fn in variants:
        us = graph_time_us(fn, iters)
        out.append({"variant": tag, "us": us, "tb_s": nbytes / us / 1e6})
        print(json.dumps(out[-1]))
    return out


def sweep_gemv(timed, cfg) -> dict:  # type: ignore[no-untyped-def]
    """Coordinate sweep of the one-row matmul tiles inside the step (a config that is fastest
    alone need not be inside the chain of kernels)."""
    import triton

    from omnistage.layers import fused, triton_gemv

    fused.set_layer_kernel(False)
    default = triton_gemv.config
    shapes = matmul_shapes(cfg)
    chosen: dict[tuple[int, int], dict] = {}
    triton_gemv.config = lambda n, k, r: chosen.get((n, k)) or default(n, k, r)
    base = timed("per-op kernels, default tiles")["us_per_step"]
    out = {"variant": "gemv sweep", "default_us": base, "shapes": {}}
    for tag, shape in shapes.items():
        best = (base, None)
        tried = []
        for bn in (4, 8, 16, 32):
            for bk in sorted({1024, min(4096, triton.next_power_of_2(shape[1]))}):
                for warps in (4, 8):
                    c = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1)
                    chosen[shape] = c
                    try:
                        us = timed(f"{tag} {bn},{bk},{warps}")["us_per_step"]
                    except Exception as exc:  # does not build or fit: skip
                        tried.append({**c, "error": str(exc)[:120]})
                        continue
                    tried.append({**c, "us": us})
                    if us < best[0]:
                        best = (us, c)
        chosen.pop(shape, None)
        out["shapes"][tag] = {"shape": shape, "best_us": best[0], "best": best[1],
                              "tried": tried}
    for tag, shape in shapes.items():
        if out["shapes"][tag]["best"] is not None:
            chosen[shape] = out["shapes"][tag]["best"]
    out["combined_us"] = timed("per-op kernels, best tiles of each shape")["us_per_step"]
    out["combined"] = {tag: out["shapes"][tag]["best"] for tag in shapes}
    triton_gemv.config = default
    return out


if __name__ == "__main__":
    main()
