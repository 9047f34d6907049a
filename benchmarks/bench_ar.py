"""Offline throughput and latency of the AR engine against Hugging Face transformers, in one
process, on the same random-weight checkpoint of a real architecture (no download needed).

    python benchmarks/bench_ar.py --preset qwen3-0.6b --num-prompts 64 --input-len 256 \
        --output-len 128 --out benchmarks/results/ar_qwen3-0.6b.json

Both sides generate exactly output-len greedy tokens per prompt (eos ignored). Baseline: HF
`generate` over the whole batch at once (equal prompt lengths, so no padding). Ours: every
prompt submitted at once to the AR engine (continuous batching, chunked prefill).
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


def bench_hf(path: Path, prompts: list[list[int]], output_len: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts, device="cuda")
    kw = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len,
              pad_token_id=0, eos_token_id=None)
    model.generate(ids[:2, :16], attention_mask=torch.ones_like(ids[:2, :16]), **{
        **kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + output_len, out.shape
    peak = torch.cuda.max_memory_allocated()
    del model
    torch.cuda.empty_cache()
    return {"seconds": elapsed, "output_tokens_per_s": len(prompts) * output_len / elapsed,
            "peak_memory_gib": peak / 2**30}


def bench_ours(path: Path, prompts: list[list[int]], output_len: int,
               max_num_batched_tokens: int) -> dict:
    from omnistage.ar.engine import AREngine
    from omnistage.configs.schema import ARConfig, KVCacheConfig, SchedulerConfig
    from omnistage.sampling_params import SamplingParams

    engine = AREngine(ARConfig(
        model=str(path), device="cuda", dtype="bfloat16",
        kv_cache=KVCacheConfig(memory_fraction=0.5),
        scheduler=SchedulerConfig(max_num_seqs=max(len(prompts), 1),
                                  max_num_batched_tokens=max_num_batched_tokens)))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            detokenize=False)

    def run(batch: list[list[int]], tag: str) -> tuple[float, list[float], int]:
        t0 = time.perf_counter()
        for i, p in enumerate(batch):
            engine.add_request(f"{tag}{i}", p, params)
        first: dict[str, float] = {}
        num_tokens = 0
        while engine.has_unfinished_requests:
            for o in engine.step():
                if o.new_token_ids and o.request_id not in first:
                    first[o.request_id] = time.perf_counter() - t0
                num_tokens += len(o.new_token_ids)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, sorted(first.values()), num_tokens

    run([p[:16] for p in prompts[:2]], "warm")
    torch.cuda.reset_peak_memory_stats()
    elapsed, ttfts, num_tokens = run(prompts, "r")
    assert num_tokens == len(prompts) * output_len, num_tokens
    return {"seconds": elapsed, "output_tokens_per_s": num_tokens / elapsed,
            "ttft_median_s": ttfts[len(ttfts) // 2], "kv_blocks": engine.kv_layout.num_blocks,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESETS))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--checkpoint-dir", default="/tmp/omnistage-bench")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    path = build_checkpoint(args.preset, Path(args.checkpoint_dir) / args.preset)
    rng = random.Random(0)
    vocab = PRESETS[args.preset]["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    ours = bench_ours(path, prompts, args.output_len, args.max_num_batched_tokens)
    hf = bench_hf(path, prompts, args.output_len)
    result = {
        "benchmark": "ar_offline_throughput", "preset": args.preset,
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "python": platform.python_version(), "dtype": "bfloat16",
        "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "omnistage": ours, "transformers": hf,
        "throughput_ratio": ours["output_tokens_per_s"] / hf["output_tokens_per_s"],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
