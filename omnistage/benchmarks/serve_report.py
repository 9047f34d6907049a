"""The summary of an `omnistage bench serve` run: percentiles of each metric over the
successful requests (vLLM's keys, `mean_ttft_ms`, `p99_itl_ms`, ...) and vLLM's labelled
table."""

from __future__ import annotations

import math
import statistics

from omnistage.benchmarks.serve_config import METRICS, Sample, ServeBenchConfig


def percentile(values: list[float], p: float) -> float:
    """numpy's default (linear between the closest ranks)."""
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def metric_values(metric: str, ok: list[Sample]) -> list[float]:
    """The metric over the successful requests, in ms (RTF: as it is)."""
    if metric == "itl":
        return [x * 1000 for s in ok for x in s.itl_s]
    get = {"ttft": lambda s: s.ttft_s, "tpot": lambda s: s.tpot_s, "e2el": lambda s: s.latency_s,
           "ttfa": lambda s: s.first_audio_s, "rtf": lambda s: s.rtf}[metric]
    scale = 1 if metric == "rtf" else 1000
    return [v * scale for v in map(get, ok) if v is not None]


def _key(metric: str, stat: str) -> str:
    return f"{stat}_{metric}" if metric == "rtf" else f"{stat}_{metric}_ms"


def _pname(p: float) -> str:
    return str(int(p)) if p == int(p) else str(p)


def summarize(cfg: ServeBenchConfig, samples: list[Sample], duration_s: float) -> dict:
    ok = [s for s in samples if s.success]
    failed = [s for s in samples if not s.success]
    n_in = sum(s.prompt_tokens or 0 for s in ok)
    n_out = sum(s.output_tokens for s in ok)
    audio_s = sum(s.audio_s for s in ok)
    images = sum(s.images for s in ok)
    out: dict = {
        "completed": len(ok), "failed": len(failed),
        "first_error": f"request {failed[0].index}: {failed[0].error}" if failed else None,
        "duration_s": duration_s,
        "max_concurrency": cfg.max_concurrency,
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "request_throughput": len(ok) / duration_s,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "output_throughput": n_out / duration_s,
        "total_token_throughput": (n_in + n_out) / duration_s,
        "total_audio_s": audio_s, "audio_throughput": audio_s / duration_s,
        "total_images": images, "image_throughput": images / duration_s,
    }
    for metric in cfg.metrics:
        values = metric_values(metric, ok)
        stats = {"mean": statistics.fmean, "median": statistics.median,
                 "std": statistics.pstdev}
        for stat, fn in stats.items():
            out[_key(metric, stat)] = fn(values) if values else None
        for p in cfg.metric_percentiles:
            out[_key(metric, f"p{_pname(p)}")] = percentile(values, p) if values else None
    return out


def table(cfg: ServeBenchConfig, summary: dict) -> str:
    """vLLM's labelled table: `Label:` padded to 40, the value after."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: object) -> None:
        if value is None:
            lines.append(f"{label:<40} {'n/a':<10}")
        elif isinstance(value, int):
            lines.append(f"{label:<40} {value:<10}")
        else:
            lines.append(f"{label:<40} {value:<10.2f}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    if cfg.max_concurrency is not None:
        row("Maximum request concurrency:", cfg.max_concurrency)
    if math.isfinite(cfg.request_rate):
        row("Request rate configured (RPS):", cfg.request_rate)
    row("Benchmark duration (s):", summary["duration_s"])
    text = cfg.endpoint_type in ("chat", "completions", "chat-audio")
    if text:
        row("Total input tokens:", summary["total_input_tokens"])
        row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if text:
        row("Output token throughput (tok/s):", summary["output_throughput"])
        row("Total Token throughput (tok/s):", summary["total_token_throughput"])
    if cfg.endpoint_type in ("speech", "chat-audio"):
        row("Total audio (s):", summary["total_audio_s"])
        row("Audio throughput (audio s/s):", summary["audio_throughput"])
    if cfg.endpoint_type == "images":
        row("Total images:", summary["total_images"])
        row("Image throughput (images/s):", summary["image_throughput"])
    for metric in cfg.metrics:
        lines.append("{s:{c}^{n}}".format(s=METRICS[metric], n=50, c="-"))
        name = metric.upper()
        unit = "" if metric == "rtf" else " (ms)"
        row(f"Mean {name}{unit}:", summary[_key(metric, "mean")])
        row(f"Median {name}{unit}:", summary[_key(metric, "median")])
        for p in cfg.metric_percentiles:
            row(f"P{_pname(p)} {name}{unit}:", summary[_key(metric, f"p{_pname(p)}")])
    lines.append("=" * 50)
    return "\n".join(lines)
