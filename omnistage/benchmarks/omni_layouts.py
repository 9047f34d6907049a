"""Qwen3-Omni-30B-A3B (real shape, random weights) served in several GPU layouts (issue 26):
one checkpoint built once, then each layout's engine started on it, warmed, and measured
(first audio, end-to-end time, audio throughput) at each concurrency, as `bench omni` does.

    tp2           thinker tensor parallel 2 on GPUs 0-1, talker and code2wav on GPU 0 (the
                  default graph under -tp 2: the 2-GPU baseline)
    tp4           thinker tensor parallel 4 on GPUs 0-3, talker and code2wav on GPU 0
    tp2-split     thinker tensor parallel 2 on GPUs 0-1, the talker on GPU 2, code2wav on 3
    ray-tp4       tp4 launched by the Ray backend (actors, placement groups)
    ray-2xtp2     the Ray backend, two whole replicas of 2 GPUs each: two thinkers of
                  tensor parallel 2 (ray_gpus 0.75 a rank, so Ray gives each rank its own
                  GPU), two talkers and two code2wavs packed beside them (0.13 and 0.1 of a
                  GPU: two talkers cannot meet on one GPU's remaining quarter)

Layouts can be mixed with --stage-override's graph edits only through their own overrides
here. The result is written after every layout (a run cut short keeps what it measured).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from omnistage.benchmarks.common import (
    environment,
    free_device_memory,
    parameter_bytes,
    write_result,
)
from omnistage.benchmarks.omni import (
    BENCH_SIZES,
    REAL_SIZES,
    OmniBenchConfig,
    audio_ratios,
    bench_ours,
    build_checkpoint,
)
from omnistage.utils.device import resolve_device


@dataclass(frozen=True, slots=True)
class Layout:
    backend: str
    tensor_parallel_size: int
    overrides: tuple[str, ...] = ()
    gpus: int = 0                              # GPUs the layout takes (what its name says)


_RAY_SHARES = ("thinker.placement.ray_gpus=0.75", "talker.placement.ray_gpus=0.13",
               "code2wav.placement.ray_gpus=0.1")
LAYOUTS = {
    "tp2": Layout("process", 2, gpus=2),
    "tp4": Layout("process", 4, gpus=4),
    "tp2-split": Layout("process", 2, ("talker.placement.devices=[2]",
                                       "code2wav.placement.devices=[3]",
                                       "talker.placement.memory_fraction=0.5"), gpus=4),
    "ray-tp4": Layout("ray", 4, _RAY_SHARES, gpus=4),
    "ray-2xtp2": Layout("ray", 2, (*_RAY_SHARES, "thinker.placement.replicas=2",
                                   "talker.placement.replicas=2", "code2wav.placement.replicas=2"), gpus=4),
}


def check_layouts(names: tuple[str, ...]) -> None:
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        raise ValueError(f"layouts {list(names)}: choose from {', '.join(LAYOUTS)}")


def run(cfg: OmniBenchConfig, names: tuple[str, ...], out_dir: Path, name: str
        ) -> dict[str, object]:
    """Build the checkpoint, then each layout in turn; the JSON rewritten after each."""
    check_layouts(names)
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result: dict[str, object] = {
        "benchmark": "omni_layouts", **environment(device),
        "dtype": str(dtype).removeprefix("torch."),
        "num_gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
        "config": {**asdict(cfg), "layouts": list(names),
                   "layout_definitions": {n: asdict(LAYOUTS[n]) for n in names},
                   "sizes_changed": BENCH_SIZES,
                   "real_sizes": REAL_SIZES if cfg.sizes == "real" else None},
        "layouts": {}, "ratios": {},
        "notes": "each layout: its own engine on the same checkpoint; first_audio: seconds "
                 "from submission to the first audio chunk; audio_s_per_s: seconds of audio "
                 "made per second at that concurrency (all submitted at once); rtf: "
                 "end-to-end seconds per second of audio."}
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-omni-layouts-") as tmp:
        path = Path(tmp) / "qwen3-omni"
        model = build_checkpoint(cfg.sizes, path, device, dtype)
        result["config"]["parameters"] = {
            k: parameter_bytes(getattr(model, k)) // model.dtype.itemsize
            for k in ("thinker", "talker", "code2wav")}
        del model
        free_device_memory(device)
        for layout_name in names:
            result["layouts"][layout_name] = _one(cfg, LAYOUTS[layout_name], path, device,
                                                  dtype)
            result["ratios"].update(_headline(layout_name, result["layouts"][layout_name], cfg))
            write_result(result, out_dir, name)
    return result


def _one(cfg: OmniBenchConfig, layout: Layout, path: Path, device: torch.device,
         dtype: torch.dtype) -> dict[str, object]:
    """One layout's engine on the checkpoint: bench_ours' rows, or the error that stopped it
    (the next layout still runs)."""
    mine = replace(cfg, backend=layout.backend, tensor_parallel_size=layout.tensor_parallel_size,
                   stage_overrides=(*cfg.stage_overrides, *layout.overrides),
                   reference_requests=0)
    try:
        out = bench_ours(path, mine, device, dtype)
    except Exception as exc:                   # noqa: BLE001 - reported in the JSON
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        free_device_memory(device)
    return out


def _headline(name: str, res: dict, cfg: OmniBenchConfig) -> dict[str, float | None]:
    if "error" in res:
        return {}
    rows = res["by_concurrency"]
    out = {f"{name}_{k}": v for k, v in audio_ratios(rows, None, cfg.concurrency, "").items()}
    for c in cfg.concurrency:
        out[f"{name}_first_audio_s_c{c}"] = rows[str(c)]["first_audio_s"]["median"]
        out[f"{name}_audio_s_per_s_c{c}"] = rows[str(c)]["audio_s_per_s"]
    return out
