"""A vLLM-Omni stage config (`--stage-configs-path FILE`, `stage_configs_path=`) translated to
our stage graph. vLLM-Omni writes `stage_args: [{stage_id, runtime, engine_args, ...}]`; each of
its stages is found by `engine_args.model_arch` and `model_stage` among the stages of our shipped
graph for that family, whose stage names, kinds, components and adapters it keeps; the keys that
tune a stage (devices, gpu_memory_utilization, max_num_seqs, sampling, ...) are mapped onto it.
Every key is mapped, ignored with a reason (it names vLLM-Omni's machinery, which has no
counterpart to set here), or refused with its path and a reason (ConfigError)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from omnistage.configs.parse import ConfigError, load_yaml

# model_arch -> (our shipped graph, {model_stage: our stage names it stands for})
FAMILIES: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "Qwen3OmniMoeForConditionalGeneration": ("qwen3_omni.yaml", {
        "thinker": ("thinker",), "talker": ("talker",), "code2wav": ("code2wav",)}),
    "Qwen2_5OmniForConditionalGeneration": ("qwen2_5_omni.yaml", {
        "thinker": ("thinker",), "talker": ("talker",), "code2wav": ("token2wav",),
        "token2wav": ("token2wav",)}),
    # vLLM-Omni runs Qwen3-TTS as one stage; here it is talker -> code2wav
    "Qwen3TTSForConditionalGeneration": ("qwen3_tts.yaml", {
        "qwen3_tts": ("talker", "code2wav")}),
    "QwenImagePipeline": ("qwen_image.yaml", {"diffusion": ("dit",), "dit": ("dit",)}),
    "WanPipeline": ("wan.yaml", {"diffusion": ("dit",), "dit": ("dit",)}),
}
# custom_process_input_func (last dotted name) -> the edge's adapter here
PROCESS_FUNCS = {"thinker2talker": "tensors", "talker2code2wav": "tensors",
                 "talker2token2wav": "tensors", "code2wav": "tensors"}

_MACHINERY = "vLLM-Omni's machinery; each stage here runs the engine of its kind"
IGNORED = {   # keys accepted with no effect, and why
    "worker_cls": _MACHINERY, "worker_type": _MACHINERY, "scheduler_cls": _MACHINERY,
    "stage_type": _MACHINERY, "distributed_executor_backend": _MACHINERY,
    "engine_output_type": "the edge's adapter carries the stage's output",
    "hf_config_name": "each component reads its part of the checkpoint's config",
    "trust_remote_code": "no remote code runs; every model's code is built in",
    "is_comprehension": "the stage that makes text is the graph's final text stage",
    "max_batch_size": "requests batch per stage up to its max_num_seqs",
    "process": "every stage runs in its own process",
    "model_arch": "picks the family's graph", "model_stage": "picks the stage",
}
STAGE_KEYS = {"stage_id", "runtime", "engine_args", "engine_input_source",
              "custom_process_input_func", "final_output", "final_output_type",
              "default_sampling_params", "is_comprehension", "stage_type"}
RUNTIME_KEYS = {"devices", "max_batch_size", "process"}
SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_tokens", "min_tokens", "seed",
                 "repetition_penalty", "detokenize", "stop_token_ids"}


def load_stage_configs(path: str | Path) -> dict[str, Any]:
    """The file at `path` as our graph's mapping (parse it with parse.from_dict)."""
    try:
        text = Path(path).expanduser().read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    return translate(load_yaml(text, str(path)), str(path))


def stage_configs_yaml(path: str | Path) -> str:
    """The translated graph as YAML text (what `--stage-config` takes)."""
    return yaml.safe_dump(load_stage_configs(path), sort_keys=False)


def translate(doc: object, where: str = "stage config") -> dict[str, Any]:
    """vLLM-Omni's `{stage_args: [...]}` as our graph's mapping."""
    if not isinstance(doc, Mapping) or "stage_args" not in doc:
        raise ConfigError(f"{where}: expected a vLLM-Omni stage config (a mapping with "
                          "'stage_args')")
    for key in doc:
        if key not in ("stage_args", "runtime"):
            _refuse(where, key, "not a key of vLLM-Omni's stage config this translation knows")
    if "runtime" in doc:
        _runtime_top(doc["runtime"], f"{where}: runtime")
    args = doc["stage_args"]
    if not isinstance(args, list) or not args:
        raise ConfigError(f"{where}: stage_args: expected a non-empty list of stages")
    arch = _arch(args, where)
    graph_file, stage_map = FAMILIES[arch]
    ours = yaml.safe_load(resources.files("omnistage.configs").joinpath(graph_file).read_text())
    by_name = {s["name"]: s for s in ours["stages"]}
    names_of: dict[int, tuple[str, ...]] = {}
    out: list[dict[str, Any]] = []
    for i, stage in enumerate(args):
        path = f"{where}: stage_args[{i}]"
        model_stage = stage.get("engine_args", {}).get("model_stage")
        if model_stage not in stage_map:
            _refuse(path, "engine_args.model_stage", f"{model_stage!r}: {arch} has no such stage "
                    f"here (known: {', '.join(stage_map)})")
        names = stage_map[model_stage]
        names_of[stage.get("stage_id", i)] = names
        mine = [copy.deepcopy(by_name[n]) for n in names]
        _apply_stage(stage, mine, path, names_of)
        out += mine
    wanted = {n for ns in names_of.values() for n in ns}
    if wanted != set(by_name):
        missing = ", ".join(n for n in by_name if n not in wanted)
        raise ConfigError(f"{where}: stage_args: {arch} needs its stages {missing} too (a "
                          "subset of the family's stages is not served here)")
    return {k: v for k, v in ours.items() if k != "stages"} | {"stages": out}


def _refuse(path: str, key: str, why: str) -> None:
    raise ConfigError(f"{path}.{key}: {why}")


def _arch(args: list, where: str) -> str:
    archs = {s.get("engine_args", {}).get("model_arch") for s in args if isinstance(s, Mapping)}
    if len(archs) != 1 or None in archs:
        raise ConfigError(f"{where}: stage_args: every stage needs the same "
                          f"engine_args.model_arch (got {sorted(map(str, archs))})")
    arch = archs.pop()
    if arch not in FAMILIES:
        raise ConfigError(f"{where}: stage_args[0].engine_args.model_arch: {arch!r} is not a "
                          f"family served here (known: {', '.join(FAMILIES)})")
    return arch


def _runtime_top(runtime: object, path: str) -> None:
    """The top-level `runtime` (windows and edges of vLLM-Omni's scheduler): ignored, as the
    edges here come from engine_input_source and stream when chunked."""
    if not isinstance(runtime, Mapping):
        raise ConfigError(f"{path}: expected a mapping")
    for key in runtime:
        if key not in ("enabled", "defaults", "edges"):
            _refuse(path, str(key), "unknown runtime key")


def _apply_stage(stage: Mapping, mine: list[dict], path: str,
                 names_of: dict[int, tuple[str, ...]]) -> None:
    if not isinstance(stage, Mapping):
        raise ConfigError(f"{path}: expected a mapping")
    for key in stage:
        if key not in STAGE_KEYS:
            _refuse(path, str(key), "not a stage key of vLLM-Omni's stage config")
    _runtime(stage.get("runtime", {}), mine, f"{path}.runtime")
    _edges(stage, mine[0], path, names_of)
    _final(stage, mine[-1], path)
    engine = stage.get("engine_args", {})
    for key, value in engine.items():
        if key not in IGNORED:   # onto the stage that vLLM-Omni's one stands for first
            _engine_key(mine[0], str(key), value, f"{path}.engine_args")
    if "default_sampling_params" in stage:
        _sampling(stage["default_sampling_params"], mine[0], f"{path}.default_sampling_params")


def _runtime(runtime: Mapping, mine: list[dict], path: str) -> None:
    for key, value in runtime.items():
        if key not in RUNTIME_KEYS:
            _refuse(path, str(key), "not a runtime key of a stage")
        if key == "devices":
            try:
                devices = [int(d) for d in str(value).split(",") if d.strip()]
            except ValueError:
                raise ConfigError(f"{path}.devices: expected GPU indices like \"0,1\", got "
                                  f"{value!r}") from None
            for s in mine:
                s.setdefault("placement", {})["devices"] = devices


def _edges(stage: Mapping, first: dict, path: str, names_of: dict[int, tuple[str, ...]]) -> None:
    sources = stage.get("engine_input_source", [])
    func = stage.get("custom_process_input_func")
    chunk = stage.get("engine_args", {}).get("async_chunk")
    expected = [inp["from"] for inp in first.get("inputs", [])]
    got = [names_of[s][-1] if s in names_of else f"stage {s}" for s in sources]
    if got != expected:
        _refuse(path, "engine_input_source", f"{sources}: {first['name']} reads "
                f"{expected or 'the prompt'} here (got {got})")
    if func is not None:
        adapter = PROCESS_FUNCS.get(str(func).rsplit(".", 1)[-1])
        if adapter is None or not first.get("inputs"):
            _refuse(path, "custom_process_input_func", f"{func!r}: no adapter here does what "
                    f"it does (known: {', '.join(PROCESS_FUNCS)})")
        for inp in first["inputs"]:
            inp["adapter"] = adapter
    if chunk is not None:
        for inp in first.get("inputs", []):
            inp["chunked"] = bool(chunk)


def _final(stage: Mapping, last: dict, path: str) -> None:
    if stage.get("final_output") and stage.get("final_output_type", last.get("final")) != \
            last.get("final"):
        _refuse(path, "final_output_type", f"{stage.get('final_output_type')!r}: stage "
                f"{last['name']} makes {last.get('final')!r} here")
    if not stage.get("final_output") and last.get("final") and last["kind"] != "ar":
        _refuse(path, "final_output", f"false: stage {last['name']}'s output is the graph's "
                f"{last['final']} output here")


# engine_args key -> (record of the stage's kind or None for the stage itself, nested key path);
# "*" stands for the stage's kind record (ar / diffusion / generation)
ENGINE_KEYS: dict[str, tuple[str, ...]] = {
    "gpu_memory_utilization": ("placement", "memory_fraction"),
    "tensor_parallel_size": ("parallel", "tp"),
    "dtype": ("dtype",),
    "max_num_seqs": ("*", "max_num_seqs"),
    "max_model_len": ("ar", "max_model_len"),
    "max_num_batched_tokens": ("ar", "max_num_batched_tokens"),
    "enforce_eager": ("ar", "enforce_eager"),
    "async_scheduling": ("ar", "async_scheduling"),
    "enable_prefix_caching": ("ar", "kv_cache", "enable_prefix_caching"),
    "seed": ("ar", "seed"),
    "async_chunk": (),   # read by _edges
}
AR_ONLY_NOOP = "has no effect on a {kind} stage here"


def _engine_key(s: dict, key: str, value: object, path: str) -> None:
    if key not in ENGINE_KEYS:
        _refuse(path, key, "not supported here (no counterpart in the stage graph; see "
                "docs/migration-vllm-omni.md)")
    keys = list(ENGINE_KEYS[key])
    if not keys:
        return
    if keys[0] == "*":
        keys[0] = s["kind"]
    if keys[0] == "ar" and s["kind"] != "ar":
        return   # e.g. enforce_eager on code2wav: no CUDA graph switch of that kind here
    node = s
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value


def _sampling(params: object, stage: dict, path: str) -> None:
    if not isinstance(params, Mapping):
        raise ConfigError(f"{path}: expected a mapping")
    if stage["kind"] != "ar":
        return   # vLLM-Omni's placeholder on a vocoder or DiT stage: nothing samples there
    sampling = stage.setdefault("ar", {}).setdefault("sampling", {})
    for key, value in params.items():
        if key not in SAMPLING_KEYS:
            _refuse(path, str(key), f"not a sampling parameter here (known: "
                    f"{', '.join(sorted(SAMPLING_KEYS))})")
        if key == "seed":
            stage["ar"]["seed"] = value
        elif not (key == "top_k" and value == -1):
            sampling[key] = value
