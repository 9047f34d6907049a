"""The ranks of a stage that spans several devices (issue 18).

    orchestrator ── zmq ──> rank 0: StageWorker, the engine's scheduler; each step it shares
                            its plan (layers/groups.py) before the forward
                            rank 1..N-1: the same engine built the same way, `engine.follow()`:
                            receive a plan, run that forward, until rank 0 says stop

Every rank is a process of its own (`process_main`), started by the same `StageRunner`, with
the same death-with-parent guard; they meet in one torch.distributed group per stage (NCCL on
CUDA, gloo on the CPU) through a file in the run folder. A follower never speaks to the
orchestrator: a rank that fails to start or dies exits, the runner sees the stage's process set
broken and the orchestrator fails the stage, ending every other rank.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from omnistage.configs.schema import GraphConfig, ParallelSizes, StageConfig

if TYPE_CHECKING:
    from omnistage.stages.launch import WorkerSpec

logger = logging.getLogger(__name__)

# What each stage kind can split (the engines refuse what their model cannot, e.g. heads that
# do not divide; this is what they have no code for at all).
SUPPORTED_AXES = {"ar": {"tp"}, "diffusion": {"tp", "ulysses", "ring", "cfg"},
                  "generation": set()}
_FLAG = {"tp": "tensor_parallel_size", "ulysses": "ulysses_degree", "ring": "ring_degree",
         "cfg": "cfg_parallel_size"}


def rank_device(device: str, stage: StageConfig, rank: int, replica: int = 0) -> str:
    """Where rank `rank` of a replica of the stage runs, given rank 0's device: the rank-th of
    the replica's devices (the CPU: the CPU)."""
    if rank == 0 or not device.startswith("cuda"):
        return device
    return f"cuda:{stage.devices_of(replica)[rank]}"


def rank_specs(spec: WorkerSpec, stage: StageConfig) -> list[WorkerSpec]:
    """One WorkerSpec per rank: rank 0's is `spec`; the others differ in rank and device."""
    return [spec] + [replace(spec, rank=r,
                             device=rank_device(spec.device, stage, r, spec.replica))
                     for r in range(1, stage.parallel.world_size)]


def check_parallel_layouts(graph: GraphConfig, device_kind: str) -> None:
    """Refuse, before anything starts, a parallel layout no engine can run: an axis the
    stage's kind cannot split, more ranks than listed devices, the in-process backend. The
    model-dependent checks (heads, vocabulary, CFG) are the engines', at their start-up."""
    for stage in graph.stages:
        sizes = stage.parallel
        if sizes.world_size == 1:
            continue
        unsupported = [_FLAG[a] for a in ("tp", "ulysses", "ring", "cfg")
                       if getattr(sizes, a) > 1 and a not in SUPPORTED_AXES[stage.kind]]
        if unsupported:
            raise ValueError(f"stage {stage.name!r}: a {stage.kind} stage cannot split by "
                             f"{', '.join(unsupported)} (it supports: "
                             f"{', '.join(_FLAG[a] for a in sorted(SUPPORTED_AXES[stage.kind])) or 'none'})")
        if graph.backend == "inproc":
            raise ValueError(f"stage {stage.name!r} spans {sizes.world_size} ranks, which "
                             "needs processes (backend: process or ray)")
        for devices in {stage.devices_of(r) for r in range(stage.placement.replicas)}:
            if device_kind.startswith("cuda") and len(devices) < sizes.world_size:
                raise ValueError(f"stage {stage.name!r} has {sizes.world_size} ranks "
                                 f"({describe(sizes)}) but lists {len(devices)} device(s) "
                                 f"{list(devices)}: give it {sizes.world_size} devices")
        check_heads_divide(stage, stage.model or graph.model)


def check_heads_divide(stage: StageConfig, model: str | None) -> None:
    """The checkpoint's heads split evenly over the stage's ranks: an AR model's query heads
    over tensor_parallel_size (its key/value heads split or replicate); a diffusion stage's
    whole layout is its pipeline's to check (stages/diffusion_component.py). Only config
    files are read; a model not found here is left to the engine's start-up."""
    from omnistage.models.loader import resolve_model_path

    try:
        path = resolve_model_path(model) if model else None
    except FileNotFoundError:
        return
    if path is None:
        return
    if stage.kind == "diffusion":
        from omnistage.stages.diffusion_component import check_parallel_layout

        check_parallel_layout(stage, str(path))
        return
    if stage.kind != "ar" or not (path / "config.json").is_file():
        return
    tp = stage.parallel.tp
    config = _component_config(json.loads((path / "config.json").read_text()), stage.component)
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads") or heads
    if isinstance(kv, int) and kv % tp and tp % kv:
        raise ValueError(f"stage {stage.name!r}: its {kv} key/value heads neither split "
                         f"evenly over nor replicate evenly on tensor_parallel_size {tp}")
    if isinstance(heads, int) and heads % tp:
        raise ValueError(f"stage {stage.name!r}: its {heads} attention heads do not divide by "
                         f"tensor_parallel_size = {tp}")


def _component_config(config: dict, component: str | None) -> dict:
    """The text model's part of a config.json: a component's `<part>_config` (Qwen3-Omni's
    qwen3_omni_thinker reads thinker_config), then its `text_config` when it has one."""
    if component:
        for key, node in config.items():
            if key.endswith("_config") and isinstance(node, dict) \
                    and key.removesuffix("_config") in component:
                config = node
                break
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def describe(sizes: ParallelSizes) -> str:
    return " x ".join(f"{_FLAG[a]} {getattr(sizes, a)}" for a in ("tp", "ulysses", "ring", "cfg")
                      if getattr(sizes, a) > 1)


def join_stage_group(spec: WorkerSpec, stage: StageConfig) -> None:
    """Join this stage's process group as rank `spec.rank` (every rank of the stage calls it)."""
    from omnistage.layers.groups import init_stage_ranks

    backend = "nccl" if spec.device.startswith("cuda") else "gloo"
    init_stage_ranks(stage.parallel, spec.rank, f"file://{spec.run_dir}/dist-{spec.stage}-{spec.replica}",
                     backend, timeout_s=stage.timeouts.startup_s)


def follow(spec: WorkerSpec, use_device: Callable[[WorkerSpec], None]) -> None:
    """A follower rank's life: join the group, build the stage's engine like rank 0 does, then
    run the forwards rank 0's plans name until it says stop."""
    from omnistage.stages.factory import build_stage_engine

    stage = spec.graph.stage(spec.stage)
    use_device(spec)
    join_stage_group(spec, stage)
    engine = build_stage_engine(stage, spec.graph.model, spec.device)
    gc.collect()      # as rank 0 does: the model lives as long as the stage, out of the
    gc.freeze()       # collector's sight
    logger.info("stage %s rank %d ready on %s", spec.stage, spec.rank, spec.device)
    engine.follow()
