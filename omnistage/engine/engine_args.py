"""vLLM's engine keywords (`Omni(model, gpu_memory_utilization=0.8, max_model_len=4096)`) as
stage overrides.

A vLLM engine is one model; ours is a graph of stages. Each keyword therefore names the stage
it changes: capacity keywords (memory, batch, length, KV cache) change the *main* stage, the
one a vLLM user means (configs/graph.py `main_stage`: a text LLM's `llm`, Qwen3-Omni's
`thinker`; for a diffusion graph, its final stage), and keywords that describe the whole
model (`dtype`, `seed`, `enforce_eager`) change every stage that has them. Which keyword
sets which field is read off the config tree (configs/engine_flags.py); a stage key by its
flat name (`replicas=2`) sets the main stage's field where the tree keeps it
(`placement.replicas`). The parallel sizes
(`tensor_parallel_size=2`, ...) change the main stage and give it consecutive devices from its
first when it lists fewer. They become `STAGE.KEY=VALUE` overrides applied
before the caller's own `stage_overrides`, which therefore win. Keywords vLLM has and we do
not are refused with what to do instead; unknown ones with a did-you-mean.
"""

from __future__ import annotations

import difflib
import json

from omnistage.configs.engine_flags import EngineFlag, engine_flags, stage_items
from omnistage.configs.graph import (PARALLEL_KEYS, main_stage, parallel_devices_override,
                                     validate_graph)
from omnistage.configs.parse import apply_overrides
from omnistage.configs.schema import MOVED, GraphConfig, StageConfig

# the keywords read off the config tree (a field whose metadata names a flag)
KEYWORDS: dict[str, EngineFlag] = {f.name: f for f in engine_flags() if f.keyword}
GRAPH_KEYS = ("connector", "backend", "ray_address")
ALIASES = {"worker_backend": "backend"}      # vLLM-Omni's name
# vLLM keywords without a counterpart here: (the value that asks for nothing, what to do)
REFUSED: dict[str, tuple[object, str]] = {
    "pipeline_parallel_size": (1, "split the model into stages instead (stage_config=...)"),
    "trust_remote_code": (False, "no model code is read from checkpoints here: drop it"),
    "tokenizer": (None, "the tokenizer is read from the model folder"),
    "kv_cache_dtype": ("auto", "the KV cache takes the stage's dtype"),
    "swap_space": (0, "preempted requests are recomputed, never swapped"),
    "cpu_offload_gb": (0, ("weights are not offloaded; lower memory use with "
                           "gpu_memory_utilization or a smaller dtype")),
    "download_dir": (None, "nothing is downloaded: pass a local folder or a cached HF id"),
    "revision": (None, "pass the folder of the revision as model"),
}
# a stage key by its flat name (`replicas=2`, `max_restarts=1`): the main stage's field at its
# place in the tree (schema.MOVED), or a field of the stage itself (`devices` moved, `dtype`)
_STAGE_KEYS = (set(MOVED) | {"component", "model"}) - set(KEYWORDS) - set(REFUSED)


def keyword_overrides(graph: GraphConfig, engine_kw: dict[str, object]) -> list[str]:
    """`STAGE.KEY=VALUE` items for the engine keywords (None values are left out); TypeError
    naming a keyword that has no place here, ValueError for one the main stage's kind does not
    read (`quantization` on an LLM)."""
    main = main_stage(graph)
    items: list[str] = []
    for key, value in engine_kw.items():
        key = ALIASES.get(key, key)
        if key in REFUSED:
            harmless, hint = REFUSED[key]
            if value is None or value == harmless:
                continue
            raise TypeError(f"Omni() keyword {key}={value!r} is not supported: {hint}")
        if key not in KEYWORDS and key not in _STAGE_KEYS and key not in GRAPH_KEYS:
            known = sorted({*KEYWORDS, *_STAGE_KEYS, *GRAPH_KEYS})
            hint = difflib.get_close_matches(key, known + list(REFUSED), n=1)
            raise TypeError(f"Omni() got an unexpected keyword argument {key!r}"
                            + (f" (did you mean {hint[0]!r}?)" if hint else "")
                            + f"; engine keywords: {', '.join(known)}")
        if value is None:
            continue
        text = json.dumps(value)
        if key in GRAPH_KEYS:
            items.append(f"{key}={value}")
        elif key in KEYWORDS:
            flag = KEYWORDS[key]
            if not flag.keyword_every_stage and main.kind not in flag.paths:
                raise ValueError(f"Omni() keyword {key} does not apply: it sets "
                                f"{' / '.join(flag.kinds)} stages, and the main stage "
                                f"{main.name!r} is a {main.kind} stage")
            items += [f"{k}={json.dumps(v)}" for k, v in stage_items(
                graph, flag, value, main=main, every_stage=flag.keyword_every_stage)]
        else:
            path = StageConfig.moved_key({"kind": main.kind}, key) or key
            items.append(f"{main.name}.{path}={text}")
    given = {k: v for k, v in engine_kw.items() if k in PARALLEL_KEYS and v is not None}
    devices = parallel_devices_override(main, given) if given else None
    return items + ([devices] if devices else [])


def apply_keywords(graph: GraphConfig, engine_kw: dict[str, object],
                   stage_overrides: list[str] | tuple[str, ...] = ()) -> GraphConfig:
    """`graph` with the engine keywords applied, then `stage_overrides` again (so that an
    explicit override wins over a keyword), validated."""
    items = keyword_overrides(graph, engine_kw)
    if not items:
        return graph
    graph = apply_overrides(graph, [*items, *stage_overrides])
    validate_graph(graph)   # the orchestrator checks the adapters
    return graph
