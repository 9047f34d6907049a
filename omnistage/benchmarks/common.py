"""What every benchmark shares: the environment record, a synchronizing clock, device memory
bandwidth, seeded random weights that two implementations of one architecture can both load,
and the JSON writer."""

from __future__ import annotations

import contextlib
import json
import math
import platform
import statistics
import time
import zlib
from importlib import metadata
from pathlib import Path

import torch
from torch import Tensor, nn

from omnistage.models.loader import _default_dtype


def environment(device: torch.device) -> dict[str, object]:
    """Where the numbers come from: device name, library versions, Python."""
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine())
    return {"device": str(device), "gpu": name if device.type == "cuda" else None,
            "device_name": name, "torch": torch.__version__,
            "cuda": torch.version.cuda if device.type == "cuda" else None,
            "transformers": version("transformers"), "diffusers": version("diffusers"),
            "omnistage": version("omnistage"), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """Host clock after the device has caught up."""
    sync(device)
    return time.perf_counter()


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summary(values: list[float]) -> dict[str, float | None]:
    """median / p90 / mean of a list of seconds (None when empty)."""
    if not values:
        return {"median": None, "p90": None, "mean": None}
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return {"median": statistics.median(ordered), "p90": p90, "mean": statistics.fmean(ordered)}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def memory_bandwidth(device: torch.device, num_bytes: int = 1 << 30, repeats: int = 20
                     ) -> float:
    """Device memory bandwidth in bytes/s: a large device-to-device copy, bytes read plus bytes
    written, median over `repeats` copies (the ceiling that single-stream decoding of a model
    whose weights do not fit in cache can reach). On CUDA each copy is timed by events around
    it (host timing counts the launch and the synchronisation: it read an H200 at 3.7 TB/s
    where events read 4.1-4.2)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)                                      # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = now(device)
            dst.copy_(src)
            times.append(now(device) - t0)
    del src, dst
    return 2 * num_bytes / statistics.median(times)


def graph_time_us(fn, iters: int, warmup: int = 3) -> float:  # type: ignore[no-untyped-def]
    """Median device time (us) of fn's kernels replayed as one CUDA graph (fn runs once
    eagerly first: kernels built, workspaces allocated)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    return replay_time_us(graph, iters)


def replay_time_us(graph: torch.cuda.CUDAGraph, iters: int, per_sample: int = 4) -> float:
    """Median device time (us) of one replay of a captured graph (its inputs as left). Each
    sample times `per_sample` replays queued behind one more, so the GPU is busy when the
    start event is recorded: the host's launch of the graph is not counted (it made a
    one-row decode step's ~800 us look 70-90 us longer, and noisy)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        graph.replay()
        start.record()
        for _ in range(per_sample):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_sample)
    return sorted(times)[len(times) // 2]


def default_dtype(dtype: torch.dtype) -> contextlib.AbstractContextManager[None]:
    """Build modules directly in `dtype` (a 20B-parameter model never exists in float32)."""
    return _default_dtype(dtype)


@torch.no_grad()
def seeded_init(model: nn.Module, seed: int = 0) -> int:
    """Fill every parameter from a generator seeded by (seed, its name), on its own device:
    two modules with the same parameter names and shapes get the same weights without ever
    being in memory together (`seeded_tensor`). Returns the number of parameters."""
    count = 0
    for module_name, module in model.named_modules():
        is_norm = "norm" in type(module).__name__.lower()
        for leaf, p in module.named_parameters(recurse=False):
            name = f"{module_name}.{leaf}" if module_name else leaf
            p.copy_(seeded_tensor(name, tuple(p.shape), is_norm and leaf != "bias", seed,
                                  p.device))
            count += p.numel()
    return count


def seeded_tensor(name: str, shape: tuple[int, ...], is_scale: bool, seed: int,
                  device: torch.device) -> Tensor:
    """The float32 values parameter `name` of `shape` gets: scales of normalization layers near
    1 (whatever their shape); other weights N(0, 1/fan_in), so activations stay O(1) through
    depth; biases small."""
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if is_scale:
        return 1.0 + 0.1 * noise
    if len(shape) == 1:
        return 0.02 * noise
    return noise / math.sqrt(math.prod(shape[1:]))


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the distinct parameters (a tied embedding counts once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def free_device_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _finite(value: object) -> object:
    """JSON has no inf / nan: they become null (a PSNR of null means identical outputs)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_result(result: dict, out_dir: str | Path, name: str) -> Path:
    """`out_dir/name.json`, pretty-printed, strict JSON; returns the path."""
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(result), indent=2, allow_nan=False) + "\n")
    return path
