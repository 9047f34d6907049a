"""AR engine against transformers' `generate`, by concurrency, on a random-weight checkpoint of
Qwen3-0.6B's architecture built in the run.

For each concurrency c, c prompts of `input_len` random tokens arrive at once and each gets
exactly `output_len` greedy tokens (eos ignored on both sides):

    ours:          every prompt added to one AREngine, then step() until all finish
                   (continuous batching, chunked prefill); per request: TTFT = first token -
                   arrival, TPOT = (finish - first token) / (output_len - 1)
    transformers:  generate() over the c prompts as one batch (equal lengths: no padding);
                   TTFT = the first call of a logits processor (after the prefill, synchronized
                   once), TPOT likewise from the end of generate
    both:          tokens/s = c * output_len / (time until the last request finished)

Single stream against the weight-streaming limit: a decode step reads every weight once, so
one request cannot beat bandwidth / weight bytes tokens/s; bandwidth is measured in the same
run (a device-to-device copy), weight bytes are those a decode step reads (a tied embedding
once; an untied input embedding table not at all: one row per token). Reported both for the
request's tokens/s (prefill included) and for its decode rate, 1 / median TPOT.
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from omnistage.benchmarks.common import (default_dtype, environment, free_device_memory,
                                         memory_bandwidth, now, parameter_bytes, ratio, summary)
from omnistage.utils.device import resolve_device

# Qwen/Qwen3-0.6B's config.json as published; "tiny" keeps the structure at toy sizes (CI).
PRESETS: dict[str, dict[str, object]] = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True),
    # Qwen/Qwen3-8B's (the tensor-parallel benchmark's model, ar_tp.py)
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                 max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True),
}


@dataclass(frozen=True, slots=True)
class ARBenchConfig:
    preset: str = "qwen3-0.6b"
    input_len: int = 128
    output_len: int = 128
    concurrency: tuple[int, ...] = (1, 8, 64)
    device: str = "auto"
    max_num_batched_tokens: int = 8192
    memory_fraction: float = 0.5        # of the device, for our engine's weights + KV cache
    checkpoint_dir: str | None = None   # None: a temporary folder
    seed: int = 0

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r}: choose one of {', '.join(PRESETS)}")
        if self.input_len < 1 or self.output_len < 2:
            raise ValueError(f"input_len={self.input_len}, output_len={self.output_len}: need "
                             "input_len >= 1 and output_len >= 2 (TPOT needs two tokens)")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency={self.concurrency}: need values >= 1")


def draw_prompts(preset: str, input_len: int, concurrency: tuple[int, ...], seed: int
                 ) -> tuple[dict[int, list[list[int]]], dict[int, list[list[int]]]]:
    """Per concurrency c: c random prompts to time, and c others for the warm-up at that
    concurrency and length (kernel selection, graph capture); the same ones would turn the
    timed prefills into prefix-cache hits."""
    rng = random.Random(seed)
    vocab = int(PRESETS[preset]["vocab_size"])

    def draw(c: int) -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(c)]

    prompts = {c: draw(c) for c in concurrency}
    return prompts, {c: draw(c) for c in concurrency}


def decode_rate(stats: dict) -> float:
    """Decode tokens/s of a run from its median time per output token."""
    tpot = stats["tpot_s"]["median"]
    return 1.0 / tpot if tpot else 0.0


def build_checkpoint(preset: str, path: Path, device: torch.device, dtype: torch.dtype) -> Path:
    """A random-weight Qwen3 checkpoint (transformers' own init) saved to `path`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    config = Qwen3Config(**PRESETS[preset], dtype=str(dtype).removeprefix("torch."))
    with torch.device(device), default_dtype(dtype):
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(path)
    del model
    return path


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step must read: every distinct parameter, less an input embedding
    table that the output head does not share (only one row of it is read per token)."""
    total = parameter_bytes(model)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if embed is not None and head is not None and embed.weight is not head.weight:
        total -= embed.weight.numel() * embed.weight.element_size()
    return total


# ---- transformers -------------------------------------------------------------------------

def _first_token_clock(device: torch.device):
    """A logits processor that stamps its first call (after the prefill's forward; one
    synchronize, then none, so the decode loop runs as it would)."""
    from transformers import LogitsProcessor

    class FirstTokenClock(LogitsProcessor):
        def __init__(self) -> None:
            self.first: float | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.first is None:
                self.first = now(device)
            return scores

    return FirstTokenClock()


def bench_transformers(model, prompts: list[list[int]], output_len: int,
                       device: torch.device) -> dict[str, object]:
    from transformers import LogitsProcessorList

    ids = torch.tensor(prompts, device=device)
    clock = _first_token_clock(device)
    t0 = now(device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=output_len, min_new_tokens=output_len,
                         eos_token_id=None, pad_token_id=0,
                         logits_processor=LogitsProcessorList([clock]))
    end = now(device)
    assert out.shape == (len(prompts), ids.shape[1] + output_len), tuple(out.shape)
    ttft = clock.first - t0
    return {"seconds": end - t0, "output_tokens_per_s": len(prompts) * output_len / (end - t0),
            "ttft_s": summary([ttft]), "tpot_s": summary([(end - clock.first) / (output_len - 1)])}


# ---- ours ---------------------------------------------------------------------------------

def bench_ours(engine, prompts: list[list[int]], output_len: int, device: torch.device,
               tag: str) -> dict[str, object]:
    from omnistage.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            detokenize=False)
    t0 = now(device)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    num_tokens = 0
    while engine.has_unfinished_requests:
        for o in engine.step():
            t = time.perf_counter()    # step() returns host token ids: the device is done
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = t
            num_tokens += len(o.new_token_ids)
            if o.finished:
                finish[o.request_id] = t
    end = now(device)
    assert num_tokens == len(prompts) * output_len, (num_tokens, len(prompts), output_len)
    ttft = [first[r] - t0 for r in first]
    tpot = [(finish[r] - first[r]) / (output_len - 1) for r in finish]
    return {"seconds": end - t0, "output_tokens_per_s": num_tokens / (end - t0),
            "ttft_s": summary(ttft), "tpot_s": summary(tpot)}


# ---- the run ------------------------------------------------------------------------------

def run(cfg: ARBenchConfig) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    from omnistage.ar.engine import AREngine
    from omnistage.configs.schema import ARConfig, SchedulerConfig

    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prompts, warm = draw_prompts(cfg.preset, cfg.input_len, cfg.concurrency, cfg.seed)
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-ar-") as tmp:
        path = build_checkpoint(cfg.preset, Path(cfg.checkpoint_dir or tmp) / cfg.preset,
                                device, dtype)

        # transformers first, then freed: our engine sizes its KV cache from free memory
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        with torch.no_grad():
            for c in cfg.concurrency:
                bench_transformers(model, warm[c], 4, device)
            hf = {c: bench_transformers(model, prompts[c], cfg.output_len, device)
                  for c in cfg.concurrency}
        del model
        free_device_memory(device)

        engine = AREngine(ARConfig(
            model=str(path), device=str(device), dtype=str(dtype).removeprefix("torch."),
            memory_fraction=cfg.memory_fraction,
            scheduler=SchedulerConfig(max_num_seqs=max(cfg.concurrency),
                                      max_num_batched_tokens=cfg.max_num_batched_tokens,
                                      max_model_len=cfg.input_len + cfg.output_len + 16)))
        for c in cfg.concurrency:
            bench_ours(engine, warm[c], 4, device, f"warm{c}")
        ours = {c: bench_ours(engine, prompts[c], cfg.output_len, device, f"c{c}")
                for c in cfg.concurrency}
        weight_bytes = decode_weight_bytes(engine.model)
        del engine
        free_device_memory(device)

    bandwidth = memory_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    return {
        "benchmark": "ar", **environment(device), "dtype": str(dtype).removeprefix("torch."),
        "config": {**asdict(cfg), "model": PRESETS[cfg.preset]},
        "by_concurrency": {str(c): {"omnistage": ours[c], "transformers": hf[c],
                                    **_ratios(ours[c], hf[c])} for c in cfg.concurrency},
        "weight_streaming": _weight_streaming(ours, hf, min(cfg.concurrency), bandwidth,
                                              weight_bytes),
        "notes": "ratios: omnistage over transformers for tokens/s, transformers over "
                 "omnistage for TTFT and TPOT (above 1: ours is faster). Each concurrency runs "
                 "once, after a warm-up at that concurrency on other prompts (no prefix-cache "
                 "hits); greedy, eos ignored, equal prompt lengths.",
    }


def _ratios(ours: dict, hf: dict) -> dict[str, float | None]:
    """Ours against transformers at one concurrency (above 1: ours is faster)."""
    return {"throughput_ratio": ratio(ours["output_tokens_per_s"], hf["output_tokens_per_s"]),
            "ttft_ratio": ratio(hf["ttft_s"]["median"], ours["ttft_s"]["median"]),
            "tpot_ratio": ratio(hf["tpot_s"]["median"], ours["tpot_s"]["median"])}


def _weight_streaming(ours: dict[int, dict], hf: dict[int, dict], single: int, bandwidth: float,
                      weight_bytes: int) -> dict[str, float]:
    """Both sides at the lowest concurrency as a share of the weight-streaming limit."""
    limit = bandwidth / weight_bytes
    return {
        "memory_bandwidth_gb_s": bandwidth / 1e9, "decode_weight_bytes": weight_bytes,
        "limit_tokens_per_s": limit, "concurrency": single,
        "omnistage_tokens_per_s": ours[single]["output_tokens_per_s"],
        "omnistage_share_of_limit": ours[single]["output_tokens_per_s"] / limit,
        "transformers_share_of_limit": hf[single]["output_tokens_per_s"] / limit,
        # decode alone (no prefill in it): the rate a decode step streams the weights at
        "omnistage_decode_tokens_per_s": decode_rate(ours[single]),
        "omnistage_decode_share_of_limit": decode_rate(ours[single]) / limit,
        "transformers_decode_share_of_limit": decode_rate(hf[single]) / limit}
