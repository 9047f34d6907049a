"""Tensor parallelism of an AR stage (issue 18): the same random Qwen3 checkpoint served with
tensor_parallel_size 1 and N through the whole engine (stage processes, one per rank), by
concurrency.

    each layout:   AsyncOmni(checkpoint, tensor_parallel_size=tp); per concurrency c, a warm-up
                   burst of c requests, then c prompts of `input_len` random tokens submitted at
                   once, `output_len` greedy tokens each (eos ignored); per request TTFT = first
                   token event - submission, TPOT = (finish - first token) / (output_len - 1)
    ratios:        tp_speedup_single_stream: decode rate (1 / median TPOT) at concurrency 1,
                   TP N over TP 1; tp_speedup_c{c}: tokens/s
    limit:         a decode step reads every weight once, split over the ranks, so one stream
                   cannot beat N x bandwidth / weight bytes tokens/s (bandwidth measured on one
                   GPU in the same run); tp_share_of_limit is the single stream's decode rate
                   over that

Both layouts run through the same stage runtime, so the comparison holds its overheads
(a process hop per token) equal; `omnistage bench ar` compares the in-process engine with
transformers.
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from omnistage.benchmarks.ar import PRESETS, build_checkpoint, draw_prompts
from omnistage.benchmarks.common import (environment, free_device_memory, memory_bandwidth,
                                         ratio, summary)
from omnistage.utils.device import resolve_device

TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class ARTPBenchConfig:
    preset: str = "qwen3-8b"
    tensor_parallel_size: int = 2
    input_len: int = 128
    output_len: int = 128
    concurrency: tuple[int, ...] = (1, 64)
    device: str = "auto"
    memory_fraction: float = 0.8
    checkpoint_dir: str | None = None
    seed: int = 0


def _burst(engine, prompts: list[list[int]], output_len: int, tag: str) -> dict[str, object]:
    """Submit every prompt at once; times from the router thread's events."""
    from omnistage.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            detokenize=False)
    lock, done = threading.Lock(), threading.Event()
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    errors: list[str] = []

    def sink_for(rid: str):
        def sink(ev) -> None:
            t = time.perf_counter()
            with lock:
                if ev.token_ids and rid not in first:
                    first[rid] = t
                if ev.error:
                    errors.append(ev.error)
                if ev.done:
                    finish[rid] = t
                    if len(finish) == len(prompts):
                        done.set()
        return sink

    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        rid = f"{tag}-{i}"
        engine.submit({"prompt_token_ids": p}, params, rid, sink=sink_for(rid))
    if not done.wait(TIMEOUT_S):
        raise RuntimeError(f"{tag}: {len(finish)} of {len(prompts)} requests finished in "
                           f"{TIMEOUT_S:g} s")
    if errors:
        raise RuntimeError(f"{tag}: {errors[0]}")
    end = max(finish.values())
    ttft = [first[r] - t0 for r in first]
    tpot = [(finish[r] - first[r]) / (output_len - 1) for r in finish]
    return {"seconds": end - t0, "output_tokens_per_s": len(prompts) * output_len / (end - t0),
            "ttft_s": summary(ttft), "tpot_s": summary(tpot)}


def _layout(path: Path, tp: int, cfg: ARTPBenchConfig, prompts: dict, warm: dict) -> dict:
    from omnistage.engine.async_omni import AsyncOmni

    t0 = time.perf_counter()
    engine = AsyncOmni(str(path), device=cfg.device, tensor_parallel_size=tp,
                       gpu_memory_utilization=cfg.memory_fraction,
                       max_num_seqs=max(cfg.concurrency),
                       max_model_len=cfg.input_len + cfg.output_len + 16)
    startup = time.perf_counter() - t0
    try:
        out = {}
        for c in cfg.concurrency:
            _burst(engine, warm[c], 4, f"tp{tp}-warm{c}")
            out[str(c)] = _burst(engine, prompts[c], cfg.output_len, f"tp{tp}-c{c}")
        return {"startup_s": startup, "by_concurrency": out}
    finally:
        engine.shutdown()


def _decode_rate(stats: dict) -> float:
    tpot = stats["tpot_s"]["median"]
    return 1.0 / tpot if tpot else 0.0


def _weight_bytes(preset: dict, dtype: torch.dtype) -> int:
    """Bytes one decode step reads: every weight once, less an untied input embedding table."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**preset))
    n = sum(p.numel() for p in model.parameters())
    if not preset.get("tie_word_embeddings", True):
        n -= model.model.embed_tokens.weight.numel()
    return n * torch.finfo(dtype).bits // 8


def run(cfg: ARTPBenchConfig) -> dict[str, object]:
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prompts, warm = draw_prompts(cfg.preset, cfg.input_len, cfg.concurrency, cfg.seed)
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-ar-tp-") as tmp:
        path = build_checkpoint(cfg.preset, Path(cfg.checkpoint_dir or tmp) / cfg.preset,
                                device, dtype)
        free_device_memory(device)    # the stages need the memory this process built it in
        layouts = {tp: _layout(path, tp, cfg, prompts, warm)
                   for tp in (1, cfg.tensor_parallel_size)}
    bandwidth = memory_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    weight_bytes = _weight_bytes(PRESETS[cfg.preset], dtype)
    tp = cfg.tensor_parallel_size
    one, many = layouts[1]["by_concurrency"], layouts[tp]["by_concurrency"]
    single = str(min(cfg.concurrency))
    limit = tp * bandwidth / weight_bytes
    ratios = {"tp_speedup_single_stream": ratio(_decode_rate(many[single]),
                                                _decode_rate(one[single])),
              "tp_share_of_limit": _decode_rate(many[single]) / limit,
              "tp1_share_of_limit": _decode_rate(one[single]) / (bandwidth / weight_bytes)}
    for c in one:
        ratios[f"tp_speedup_c{c}"] = ratio(many[c]["output_tokens_per_s"],
                                           one[c]["output_tokens_per_s"])
    return {"benchmark": "ar_tp", **environment(device), "dtype": str(dtype).removeprefix("torch."),
            "num_gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
            "config": {**asdict(cfg), "model": PRESETS[cfg.preset]},
            "layouts": {f"tp{k}": v for k, v in layouts.items()},
            "weight_streaming": {"memory_bandwidth_gb_s_per_gpu": bandwidth / 1e9,
                                 "decode_weight_bytes": weight_bytes,
                                 "limit_tokens_per_s": limit},
            "ratios": ratios,
            "notes": "both layouts through AsyncOmni (stage processes); decode rate = 1 / "
                     "median TPOT; the limit is tensor_parallel_size x one GPU's measured "
                     "bandwidth over the weight bytes a decode step reads."}
