"""vLLM's engine keywords (`Omni(model, gpu_memory_utilization=0.8, max_model_len=4096)`) as
stage overrides.

A vLLM engine is one model; ours is a graph of stages. Each keyword therefore names the stage
it changes: capacity keywords (memory, batch, length, KV cache) change the *main* stage, the
one a vLLM user means (configs/graph.py `main_stage`: a text LLM's `llm`, Qwen3-Omni's
`thinker`; for a diffusion graph, its final stage), and keywords that describe the whole
model (`dtype`, `seed`, `enforce_eager`) change every stage. The parallel sizes
(`tensor_parallel_size=2`, ...) change the main stage and give it consecutive devices from its
first when it lists fewer. They become `STAGE.KEY=VALUE` overrides applied
before the caller's own `stage_overrides`, which therefore win. Keywords vLLM has and we do
not are refused with what to do instead; unknown ones with a did-you-mean.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import fields

from omnistage.configs.graph import (PARALLEL_KEYS, main_stage, parallel_devices_override,
                                     validate_graph)
from omnistage.configs.parse import apply_overrides
from omnistage.configs.schema import GraphConfig, StageConfig

# vLLM name -> our stage key, on the main stage
MAIN_STAGE = {"gpu_memory_utilization": "memory_fraction", "max_num_seqs": "max_num_seqs",
              "max_model_len": "max_model_len", "max_num_batched_tokens": "max_num_batched_tokens",
              "block_size": "block_size", "enable_prefix_caching": "enable_prefix_caching",
              "enable_chunked_prefill": "enable_chunked_prefill",
              "quantization": "quantization",     # fp8, diffusion stages (layers/fp8.py)
              **{key: key for key in PARALLEL_KEYS}}
# keys that describe the whole model: every stage
EVERY_STAGE = ("dtype", "seed", "enforce_eager", "async_scheduling", "startup_timeout_s")
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
_STAGE_FIELDS = {f.name for f in fields(StageConfig)} - {"name", "kind", "inputs", "final"}


def keyword_overrides(graph: GraphConfig, engine_kw: dict[str, object]) -> list[str]:
    """`STAGE.KEY=VALUE` items for the engine keywords (None values are left out); TypeError
    naming a keyword that has no place here."""
    main = main_stage(graph).name
    items: list[str] = []
    for key, value in engine_kw.items():
        key = ALIASES.get(key, key)
        if key in REFUSED:
            harmless, hint = REFUSED[key]
            if value is None or value == harmless:
                continue
            raise TypeError(f"Omni() keyword {key}={value!r} is not supported: {hint}")
        if key not in MAIN_STAGE and key not in _STAGE_FIELDS and key not in GRAPH_KEYS:
            known = sorted({*MAIN_STAGE, *_STAGE_FIELDS, *GRAPH_KEYS})
            hint = difflib.get_close_matches(key, known + list(REFUSED), n=1)
            raise TypeError(f"Omni() got an unexpected keyword argument {key!r}"
                            + (f" (did you mean {hint[0]!r}?)" if hint else "")
                            + f"; engine keywords: {', '.join(known)}")
        if value is None:
            continue
        text = json.dumps(value)
        if key in GRAPH_KEYS:
            items.append(f"{key}={value}")
        elif key in EVERY_STAGE:
            items += [f"{s.name}.{key}={text}" for s in graph.stages]
        else:
            items.append(f"{main}.{MAIN_STAGE.get(key, key)}={text}")
    given = {k: v for k, v in engine_kw.items() if k in PARALLEL_KEYS and v is not None}
    devices = parallel_devices_override(main_stage(graph), given) if given else None
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
