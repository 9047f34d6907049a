"""Offline throughput and latency of the AR engine against Hugging Face transformers, in one
process, on the same random-weight checkpoint of a real architecture (no download needed).

    python -m omnistage.benchmarks.ar_offline --preset qwen3-0.6b --num-prompts 64 \
        --input-len 256 --output-len 128 --out benchmarks/results/ar_qwen3-0.6b.json
    python -m omnistage.benchmarks.ar_offline --single-stream --output-len 256   # batch 1

Both sides generate exactly output-len greedy tokens per prompt (eos ignored). Baseline: HF
`generate` over the prompts, `concurrency` at a time (equal prompt lengths, so no padding).
Ours: every prompt submitted at once to the AR engine, at most `concurrency` running together
(continuous batching, chunked prefill).

--single-stream: one prompt; the result is the decode speed (tokens/s after the first token)
of both sides, and ours as a share of the weight-streaming limit: measured device-to-device
copy bandwidth / bytes of weights read per decode step.

--skip-hf runs ours only (run as a file, `PYTHONPATH=OLD python
omnistage/benchmarks/ar_offline.py --skip-hf ...`, it measures an older omnistage); --enforce-eager, --no-fused and --attention-backend switch the new paths off
one by one (--no-layer-kernel: one kernel per decoder layer at one row; --no-gemv: the one-row
matrix-vector kernels (and the layer kernel); --no-pdl: programmatic dependent launch).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

PRESETS = {
    # Qwen/Qwen3-0.6B's config.json, as published
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def build_checkpoint(preset: str, path: Path) -> Path:
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    config = Qwen3Config(**PRESETS[preset], dtype="bfloat16")
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def bench_hf(path: Path, prompts: list[list[int]], output_len: int,
             concurrency: int | None = None) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    kw = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len,
              pad_token_id=0, eos_token_id=None)
    warm = torch.tensor([p[:16] for p in prompts[:2]], device="cuda")
    model.generate(warm, attention_mask=torch.ones_like(warm), **{
        **kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step = concurrency or len(prompts)
    t0 = time.perf_counter()
    for lo in range(0, len(prompts), step):
        ids = torch.tensor(prompts[lo:lo + step], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        assert out.shape[1] == ids.shape[1] + output_len, out.shape
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated()
    del model
    torch.cuda.empty_cache()
    return {"seconds": elapsed, "output_tokens_per_s": len(prompts) * output_len / elapsed,
            "peak_memory_gib": peak / 2**30}


def hf_decode_speed(path: Path, prompt: list[int], output_len: int) -> dict:
    """Batch-1 decode tokens/s of HF generate: (time of n tokens - time of 1) / (n - 1)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt], device="cuda")

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed(4)  # warm-up
    per_token = (timed(output_len) - timed(1)) / (output_len - 1)
    return {"decode_s_per_token": per_token, "decode_tokens_per_s": 1 / per_token}


ASYNC_SCHEDULING = True     # --no-async-scheduling
QUANTIZATION: str | None = None     # --quantization: ar.quantization (fp8, int8, int4)


def stage_quantization(method: str):  # -> ComponentQuantization
    """--quantization's method as ARConfig takes it (what a stage's `ar.quantization: fp8`
    becomes)."""
    from omnistage.configs.quantization import ar_method, read_quantization

    return ar_method(read_quantization(method), None)


def make_engine(path: Path, max_num_seqs: int, max_num_batched_tokens: int,
                enforce_eager: bool = False, attention_backend: str = "auto"):  # -> AREngine
    from omnistage.ar.engine import AREngine
    from omnistage.configs.schema import ARConfig, SchedulerConfig

    # Only name the newer options when they differ from the defaults, so that an older
    # omnistage (the "before" of a comparison) runs under this script too.
    extra = {}
    if not ASYNC_SCHEDULING:
        extra["async_scheduling"] = False
    if enforce_eager:
        extra["enforce_eager"] = True
    if attention_backend != "auto":
        extra["attention_backend"] = attention_backend
    if QUANTIZATION:
        extra["quantization"] = stage_quantization(QUANTIZATION)
    return AREngine(ARConfig(
        model=str(path), device="cuda", dtype="bfloat16",
        memory_fraction=0.5,
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens), **extra))


def run_engine(engine, prompts: list[list[int]], output_len: int, tag: str
               ) -> tuple[float, dict[str, list[float]], int]:
    """Submit all prompts, step to the end: (seconds, token times per request, tokens)."""
    from omnistage.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            detokenize=False)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params)
    times: dict[str, list[float]] = {}
    num_tokens = 0
    while engine.has_unfinished_requests:
        for o in engine.step():
            if o.new_token_ids:
                times.setdefault(o.request_id, []).append(time.perf_counter() - t0)
            num_tokens += len(o.new_token_ids)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, times, num_tokens


def bench_ours(path: Path, prompts: list[list[int]], output_len: int,
               max_num_batched_tokens: int, concurrency: int | None = None,
               enforce_eager: bool = False, attention_backend: str = "auto") -> dict:
    engine = make_engine(path, concurrency or max(len(prompts), 1), max_num_batched_tokens,
                         enforce_eager, attention_backend)
    run_engine(engine, [p[:16] for p in prompts[:2]], 8, "warm")
    torch.cuda.reset_peak_memory_stats()
    elapsed, times, num_tokens = run_engine(engine, prompts, output_len, "r")
    assert num_tokens == len(prompts) * output_len, num_tokens
    ttfts = sorted(t[0] for t in times.values())
    return {"seconds": elapsed, "output_tokens_per_s": num_tokens / elapsed,
            "ttft_median_s": ttfts[len(ttfts) // 2], "kv_blocks": engine.kv_layout.num_blocks,
            "cuda_graphs": getattr(getattr(engine.runner, "graphs", None), "sizes", None),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def ours_decode_speed(path: Path, prompt: list[int], output_len: int,
                      enforce_eager: bool = False, attention_backend: str = "auto") -> dict:
    engine = make_engine(path, 1, 4096, enforce_eager, attention_backend)
    run_engine(engine, [prompt[:16]], 8, "warm")
    _, times, _ = run_engine(engine, [prompt], output_len, "s")
    (t,) = times.values()
    per_token = (t[-1] - t[0]) / (len(t) - 1)
    return {"ttft_s": t[0], "decode_s_per_token": per_token, "decode_tokens_per_s": 1 / per_token}


def weight_streaming_limit(path: Path) -> dict:
    """Tokens/s at which a batch-1 decode step only streams the weights once from memory."""
    from safetensors import safe_open

    from omnistage.benchmarks.common import memory_bandwidth

    num_bytes = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                t = st.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                num_bytes += n * 2                       # bf16
    bandwidth = memory_bandwidth(torch.device("cuda"), 2**30, repeats=10)
    torch.cuda.empty_cache()
    return {"weight_bytes": num_bytes, "copy_bandwidth_gb_s": bandwidth / 1e9,
            "limit_tokens_per_s": bandwidth / num_bytes}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESETS))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=None,
                    help="sequences in flight at once (default: all prompts)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--single-stream", action="store_true",
                    help="batch-1 decode speed against the weight-streaming limit")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--no-fused", action="store_true", help="no fused Triton norm/rope/act")
    ap.add_argument("--no-gemv", action="store_true",
                    help="no one-row matrix-vector kernels (norm / SiLU fused in): cuBLAS")
    ap.add_argument("--gemv-rows", type=int, default=None,
                    help="the most rows a matmul takes the fused kernels with (1: one-row "
                         "steps only; 16: small batches on the tensor-core variant); default: "
                         "as measured on this GPU (triton_gemv.max_rows)")
    ap.add_argument("--gemv-config", default=None, metavar="BN,BK,WARPS,STAGES",
                    help="tile sizes for every matrix-vector kernel but the lm_head's instead of "
                         "triton_gemv.config")
    ap.add_argument("--no-pdl", action="store_true",
                    help="Triton kernels without programmatic dependent launch")
    ap.add_argument("--pdl-early", choices=("on", "off"), default=None,
                    help="each Triton kernel lets its dependent launch at its start, before its "
                         "wait (pdl.set_early_launch); default: pdl.py's choice")
    ap.add_argument("--no-layer-kernel", action="store_true",
                    help="one-row decodes layer by layer in per-op kernels, not one kernel each")
    ap.add_argument("--layer-kernel", action="store_true",
                    help="one kernel per decoder layer at one row on any GPU (by default only "
                         "where it measured faster)")
    ap.add_argument("--layer-kernel-config", default=None, metavar="MAX_TILE,WARPS",
                    help="weight elements a program holds per chunk, and warps, of the layer "
                         "kernel (triton_decoder_layer.MAX_TILE, NUM_WARPS)")
    ap.add_argument("--decode-attention", choices=("on", "off"), default=None,
                    help="small decode batches: q/k norm + rotary + K/V store, attention and "
                         "the merge of its slices as one kernel (on) or three (off); default: "
                         "fused.py's choice")
    ap.add_argument("--decode-attention-config", default=None, metavar="BLOCK_T,WARPS,SLICES",
                    help="the one-kernel decode attention's keys a tile, warps and most slices "
                         "(triton_decode_attention.BLOCK_T, NUM_WARPS, MAX_SPLITS)")
    ap.add_argument("--max-kv-splits", type=int, default=None,
                    help="split-K slices of a small decode batch's attention at most "
                         "(triton_attention.MAX_SPLITS and the layer kernel's, a power of two)")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="read each decode step's tokens before launching the next")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--quantization", default=None, choices=("fp8", "int8", "int4"),
                    help="every linear but the head quantized at load (ar.quantization): "
                         "8 bits (fp8, int8) or 4-bit W4A16 in groups of 128 (int4); the "
                         "weight-streaming limit stays the bf16 weights'")
    ap.add_argument("--checkpoint-dir", default="/tmp/omnistage-bench")
    ap.add_argument("--out", default=None)
    _int4_arguments(ap)
    return ap


def _int4_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--int4-kernel", choices=("rows", "split"), default=None,
                    help="--quantization int4's few-row kernel (triton_int4.set_kernel): the "
                         "first (rows) or split-K (split); default: as triton_int4.SPLIT_FASTER")
    ap.add_argument("--int4-tiles", type=Path, default=None, metavar="SWEEP_JSON",
                    help="the split kernel's tiles per shape from int4_sweep.py's --out")


def _apply_switches(args: argparse.Namespace) -> None:
    """The kernel and scheduling switches, set on their modules before the engine is built."""
    global QUANTIZATION
    QUANTIZATION = args.quantization
    if args.no_fused or args.no_gemv:
        from omnistage.layers import fused
        fused.set_enabled(not args.no_fused)
        fused.set_gemv(not args.no_gemv)
    if args.gemv_rows is not None:
        from omnistage.layers import fused
        fused.set_gemv_rows(args.gemv_rows)
    if args.no_layer_kernel or args.layer_kernel:
        from omnistage.layers import fused
        fused.set_layer_kernel(bool(args.layer_kernel))
    if args.layer_kernel_config:
        from omnistage.layers import triton_decoder_layer
        tile, warps = map(int, args.layer_kernel_config.split(","))
        triton_decoder_layer.MAX_TILE, triton_decoder_layer.NUM_WARPS = tile, warps
    if args.decode_attention:
        from omnistage.layers import fused
        fused.set_decode_attention(args.decode_attention == "on")
    if args.decode_attention_config:
        from omnistage.layers import triton_decode_attention as tda
        tda.BLOCK_T, tda.NUM_WARPS, tda.MAX_SPLITS = map(
            int, args.decode_attention_config.split(","))
    if args.max_kv_splits:   # the per-op attention's and the layer kernel's
        from omnistage.layers import triton_attention, triton_decoder_layer
        triton_attention.MAX_SPLITS = args.max_kv_splits
        triton_decoder_layer.MAX_SPLITS = args.max_kv_splits
    if args.no_async_scheduling:
        global ASYNC_SCHEDULING
        ASYNC_SCHEDULING = False
    if args.no_pdl:
        from omnistage.layers import pdl
        pdl.set_enabled(False)
    if args.pdl_early:
        from omnistage.layers import pdl
        pdl.set_early_launch(args.pdl_early == "on")
    if args.int4_kernel:
        from omnistage.layers import triton_int4
        triton_int4.set_kernel(args.int4_kernel)
    if args.int4_tiles:
        from omnistage.layers import triton_int4_split
        triton_int4_split.load_tiles(json.loads(args.int4_tiles.read_text()))
    if args.gemv_config:
        from omnistage.layers import triton_gemv
        bn, bk, nw, ns = map(int, args.gemv_config.split(","))
        default = triton_gemv.config   # the lm_head (a vocabulary of rows) keeps its own
        triton_gemv.config = lambda n, k, rows: (
            dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns) if n < 32768
            else default(n, k, rows))


def _options(args: argparse.Namespace) -> dict[str, object]:
    """The switches as the result records them."""
    return {"enforce_eager": args.enforce_eager, "no_fused": args.no_fused,
            "gemv": not (args.no_gemv or args.no_fused),
            "pdl": not args.no_pdl, "pdl_early": args.pdl_early,
            "gemv_config": args.gemv_config,
            "layer_kernel": ("off" if args.no_layer_kernel or args.no_gemv or args.no_fused
                             else "on" if args.layer_kernel else "auto"),
            "layer_kernel_config": args.layer_kernel_config,
            "decode_attention": args.decode_attention,
            "decode_attention_config": args.decode_attention_config,
            "async_scheduling": not args.no_async_scheduling,
            "max_kv_splits": args.max_kv_splits,
            "attention_backend": args.attention_backend, "quantization": args.quantization,
            "int4_kernel": args.int4_kernel,
            "int4_tiles": None if args.int4_tiles is None else str(args.int4_tiles)}


def main() -> None:
    args = _parser().parse_args()
    _apply_switches(args)
    path = build_checkpoint(args.preset, Path(args.checkpoint_dir) / args.preset)
    rng = random.Random(0)
    vocab = PRESETS[args.preset]["vocab_size"]
    num_prompts = 1 if args.single_stream else args.num_prompts
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)]
               for _ in range(num_prompts)]
    import omnistage

    result = {
        "benchmark": "ar_single_stream" if args.single_stream else "ar_offline_throughput",
        "preset": args.preset, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "python": platform.python_version(), "dtype": "bfloat16",
        "omnistage_path": str(Path(omnistage.__file__).parent),
        "num_prompts": num_prompts, "concurrency": args.concurrency or num_prompts,
        "input_len": args.input_len, "output_len": args.output_len,
        "options": _options(args),
    }
    if args.single_stream:
        ours = ours_decode_speed(path, prompts[0], args.output_len, args.enforce_eager,
                                 args.attention_backend)
        limit = weight_streaming_limit(path)
        ours["share_of_weight_streaming_limit"] = (ours["decode_tokens_per_s"]
                                                   / limit["limit_tokens_per_s"])
        result.update(omnistage=ours, weight_streaming=limit)
        if not args.skip_hf:
            hf = hf_decode_speed(path, prompts[0], args.output_len)
            result.update(transformers=hf, decode_speed_ratio=(
                ours["decode_tokens_per_s"] / hf["decode_tokens_per_s"]))
    else:
        ours = bench_ours(path, prompts, args.output_len, args.max_num_batched_tokens,
                          args.concurrency, args.enforce_eager, args.attention_backend)
        result["omnistage"] = ours
        if not args.skip_hf:
            hf = bench_hf(path, prompts, args.output_len, args.concurrency)
            result.update(transformers=hf, throughput_ratio=(
                ours["output_tokens_per_s"] / hf["output_tokens_per_s"]))
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
