"""vLLM's engine flags on `omnistage serve`, and the stage keys they set.

    --max-num-seqs 8     ->  thinker.ar.max_num_seqs=8    (the main stage)
    --dtype bfloat16     ->  thinker.dtype=bfloat16, talker.dtype=..., code2wav.dtype=...

Which flag sets which key is read off the config tree (configs/engine_flags.py).

They become `--stage-override` items put before the user's own, so an explicit
`--stage-override STAGE.KEY=VALUE` still wins. The main stage is the one the model is named
after: the first ar stage (an LLM, Qwen3-Omni's thinker), else the diffusion stage whose output
goes to the client (the denoiser, not a split graph's text encoder).

The parallel flags (`-tp`, `--ulysses-degree`, `--ring-degree`, `--cfg-parallel-size`) also
give the main stage consecutive devices from its first when it lists fewer than its ranks.

A flag is refused, not ignored, when the main stage's kind never reads its key (`--max-model-len`
on an image model), and `max_model_len` above the model's own limit is refused rather than
capped by the engine at start-up.
"""

from __future__ import annotations

import argparse
import json

from omnistage.configs.engine_flags import engine_flags, stage_items
from omnistage.configs.graph import PARALLEL_KEYS, main_stage, parallel_devices_override
from omnistage.configs.schema import GraphConfig

# flags for the front door that still belong to one kind of main stage
FRONT_DOOR_FLAGS = {"chat_template": ("ar",)}


def flag_overrides(graph: GraphConfig, args: argparse.Namespace) -> list[str]:
    """`STAGE.KEY=VALUE` items for the engine flags given (None: not given); ValueError for a
    flag that does not apply to this graph's main stage."""
    main = main_stage(graph)
    items = graph_flag_overrides(args)
    for name, kinds in FRONT_DOOR_FLAGS.items():
        if getattr(args, name, None) is not None and main.kind not in kinds:
            _refuse("--" + name.replace("_", "-"), "is for", kinds, main.name, main.kind)
    for flag in engine_flags():
        value = getattr(args, flag.name, None) if flag.cli else None
        if value is None:
            continue
        if main.kind not in flag.paths:
            _refuse(flag.flag, f"sets {' / '.join(dict.fromkeys(flag.paths.values()))} of",
                    flag.kinds, main.name, main.kind)
        items += [f"{key}={json.dumps(v)}" for key, v in
                  stage_items(graph, flag, value, main=main, every_stage=flag.every_stage)]
    given = {key: getattr(args, key) for key in PARALLEL_KEYS if getattr(args, key, None)}
    devices = parallel_devices_override(main, given) if given else None
    return items + ([devices] if devices else [])


def _refuse(flag: str, what: str, kinds: tuple[str, ...], main: str, kind: str) -> None:
    raise ValueError(f"{flag} does not apply to this model: it {what} {' / '.join(kinds)} "
                     f"stages, and the main stage {main!r} is a {kind} stage")


def graph_flag_overrides(args: argparse.Namespace) -> list[str]:
    """`KEY=VALUE` items for the graph-level flags given: where the stages run."""
    items = []
    if getattr(args, "worker_backend", None):
        items.append(f"backend={args.worker_backend}")
    if getattr(args, "ray_address", None):
        items.append(f"ray_address={json.dumps(args.ray_address)}")
    return items


def check_max_model_len(graph: GraphConfig) -> None:
    """Refuse an ar stage's max_model_len above its checkpoint's max_position_embeddings (the
    engine would lower it silently). Only config.json is read; nothing loads."""
    for stage in graph.stages:
        if stage.ar is None or stage.ar.max_model_len is None:
            continue
        model = stage.model or graph.model
        if model is None:
            continue
        from omnistage.models.loader import resolve_model_path   # imports torch

        config = resolve_model_path(model) / "config.json"
        if not config.is_file():
            continue
        limit = max_positions(json.loads(config.read_text()), stage.component)
        if limit is not None and stage.ar.max_model_len > limit:
            raise ValueError(
                f"max_model_len {stage.ar.max_model_len} (--max-model-len, stage "
                f"{stage.name!r}) is above this model's limit of {limit} tokens "
                f"(max_position_embeddings in {config}); use --max-model-len {limit} or less")


def max_positions(config: dict, component: str | None) -> int | None:
    """max_position_embeddings of a checkpoint's config.json, or of the part that `component`
    names (Qwen3-Omni's `qwen3_omni_thinker` reads `thinker_config.text_config`)."""
    nodes = [v for k, v in config.items() if component and k.endswith("_config")
             and k.removesuffix("_config") in component] if component else []
    for node in [*nodes, config]:
        for part in (node, node.get("text_config") if isinstance(node, dict) else None):
            value = part.get("max_position_embeddings") if isinstance(part, dict) else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None
