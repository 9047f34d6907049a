"""A vLLM-Omni stage config (`--stage-configs-path FILE`, `stage_configs_path=`) translated to
our stage graph. vLLM-Omni writes `stage_args: [{stage_id, runtime, engine_args, ...}]`; its
stages' `(engine_args.model_arch, model_stage)` pairs pick one of our shipped graphs
(vllm_stage_keys.VARIANTS), whose stage names, kinds, components and adapters the result keeps;
the keys that tune a stage (devices, gpu_memory_utilization, max_num_seqs, sampling, ...) are
mapped onto it. Every key is mapped, ignored with a reason (it names vLLM-Omni's machinery, which
has no counterpart to set here), or refused with its path and a reason (ConfigError).

    vLLM-Omni stage_args            our stages
    [0] thinker   ───────────────>  thinker
    [1] talker    ───────────────>  talker
    [2] code2wav  ───────────────>  code2wav
    [0] qwen3_tts (one stage)  ──>  talker, code2wav    (one of theirs, two of ours)
    [1] denoise, [2] decode  ────>  dit                 (two of theirs folded into one of ours)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from omnistage.configs.parse import ConfigError, load_yaml
from omnistage.configs.vllm_stage_keys import (
    CONNECTOR_EXTRA,
    CONNECTOR_KEYS,
    DIFFUSION_SAMPLING_KEYS,
    ENGINE_KEYS,
    IGNORED,
    ONLY_VALUE,
    PROCESS_FUNCS,
    RUNTIME_KEYS,
    SAMPLING_KEYS,
    STAGE_KEYS,
    TOP_RUNTIME_KEYS,
    VARIANTS,
)

Table = dict[tuple[str, str], tuple[str, ...]]


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
    """vLLM-Omni's `{stage_args: [...], async_chunk, runtime}` as our graph's mapping."""
    args = _stage_args(doc, where)
    options = _runtime_top(doc.get("runtime", {}), f"{where}: runtime")
    _, table, ours = _variant(args, where)
    by_name = {s["name"]: s for s in ours["stages"]}
    built: dict[str, dict] = {}
    names_of: dict[object, tuple[str, ...]] = {}
    finals: dict[str, list[tuple[int, Mapping]]] = {}
    for i, stage in enumerate(args):
        names = table[_pair(stage)]
        folded = names[0] in built
        mine = [built.setdefault(n, copy.deepcopy(by_name[n])) for n in names]
        _apply_stage(stage, mine, f"{where}: stage_args[{i}]", names_of, folded,
                     doc.get("async_chunk"))
        names_of[stage.get("stage_id", i)] = names
        finals.setdefault(names[-1], []).append((i, stage))
    for name, group in finals.items():
        _final(group, built[name], where)
    stages = [built[n] for n in by_name if n in built]
    _connector_options(options, stages[-1], f"{where}: runtime.connectors")
    return {k: v for k, v in ours.items() if k != "stages"} | {"stages": stages}


def _stage_args(doc: object, where: str) -> list[Mapping]:
    """The file's `stage_args`, once its top-level keys are checked."""
    stages = doc.get("stages") if isinstance(doc, Mapping) else None
    if isinstance(stages, list) and any(isinstance(s, Mapping) and "stage_id" in s
                                        for s in stages):
        raise ConfigError(f"{where}: a vLLM-Omni deploy config (--deploy-config: `stages` "
                          "with stage_id, no model_arch) is not translated here; use a "
                          "stage_args file (vllm_omni/model_executor/stage_configs/) or "
                          "omnistage's --stage-config")
    if not isinstance(doc, Mapping) or "stage_args" not in doc:
        raise ConfigError(f"{where}: expected a vLLM-Omni stage config (a mapping with "
                          "'stage_args')")
    for key in doc:
        if key not in ("stage_args", "runtime", "async_chunk"):
            _refuse(where, key, "not a key of vLLM-Omni's stage config this translation knows")
    args = doc["stage_args"]
    if not isinstance(args, list) or not args:
        raise ConfigError(f"{where}: stage_args: expected a non-empty list of stages")
    for i, stage in enumerate(args):
        if not isinstance(stage, Mapping) or not isinstance(stage.get("engine_args", {}),
                                                            Mapping):
            raise ConfigError(f"{where}: stage_args[{i}]: expected a mapping with an "
                              "engine_args mapping")
    return args


def _refuse(path: str, key: str, why: str) -> None:
    raise ConfigError(f"{path}.{key}: {why}")


def _pair(stage: Mapping) -> tuple[str, str]:
    engine = stage.get("engine_args", {})
    return (engine.get("model_arch", engine.get("model_class_name")), engine.get("model_stage"))


def _shipped(graph_file: str) -> dict[str, Any]:
    return yaml.safe_load(resources.files("omnistage.configs").joinpath(graph_file).read_text())


def _variant(args: list, where: str) -> tuple[str, Table, dict[str, Any]]:
    """The first shipped graph whose table holds every stage's pair and whose stages they all
    cover; else the reason none does."""
    pairs = [_pair(s) for s in args]
    archs = {a for _, table in VARIANTS for a, _ in table}
    for i, (arch, model_stage) in enumerate(pairs):
        if arch not in archs:
            _refuse(f"{where}: stage_args[{i}]", "engine_args.model_arch", f"{arch!r} is not a "
                    f"family served here (known: {', '.join(sorted(archs))})")
        if not any((arch, model_stage) in table for _, table in VARIANTS):
            known = sorted({m for _, table in VARIANTS for a, m in table if a == arch})
            _refuse(f"{where}: stage_args[{i}]", "engine_args.model_stage", f"{model_stage!r}: "
                    f"{arch} has no such stage here (known: {', '.join(known)})")
    missing = ""
    for graph_file, table in VARIANTS:
        if all(p in table for p in pairs):
            ours = _shipped(graph_file)
            covered = {n for p in pairs for n in table[p]}
            left = [s["name"] for s in ours["stages"] if s["name"] not in covered]
            if not left:
                return graph_file, table, ours
            missing = missing or ", ".join(left)
    if missing:
        raise ConfigError(f"{where}: stage_args: {pairs[0][0]} needs its stages {missing} too "
                          "(a subset of the family's stages is not served here)")
    raise ConfigError(f"{where}: stage_args: stages {pairs} do not make one graph here")


def _runtime_top(runtime: object, path: str) -> dict[str, object]:
    """The top-level `runtime` (windows, edges and connectors of vLLM-Omni's scheduler): ignored,
    as the edges here come from engine_input_source and stream when chunked; the connectors'
    codec chunk size is returned as the code2wav option it sets."""
    if not isinstance(runtime, Mapping):
        raise ConfigError(f"{path}: expected a mapping")
    options: dict[str, object] = {}
    for key in runtime:
        if key not in TOP_RUNTIME_KEYS:
            _refuse(path, str(key), "unknown runtime key")
    for name, connector in (runtime.get("connectors") or {}).items():
        where = f"{path}.connectors.{name}"
        if not isinstance(connector, Mapping):
            raise ConfigError(f"{where}: expected a mapping")
        for key in connector:
            if key not in CONNECTOR_KEYS:
                _refuse(where, str(key), "not a connector key")
        for key, value in (connector.get("extra") or {}).items():
            if key not in CONNECTOR_EXTRA:
                _refuse(f"{where}.extra", str(key), "no counterpart here (known: "
                        f"{', '.join(CONNECTOR_EXTRA)})")
            if CONNECTOR_EXTRA[key] is not None:
                options[CONNECTOR_EXTRA[key]] = value
    return options


def _connector_options(options: dict[str, object], last: dict, path: str) -> None:
    if not options:
        return
    if last["kind"] != "generation":
        raise ConfigError(f"{path}: codec chunk sizes set a vocoder stage; {last['name']} is "
                          f"of kind {last['kind']}")
    last.setdefault("generation", {}).setdefault("options", {}).update(options)


def _apply_stage(stage: Mapping, mine: list[dict], path: str,
                 names_of: dict[object, tuple[str, ...]], folded: bool,
                 async_chunk: object) -> None:
    """Set `stage`'s keys on our stages `mine`. A stage `folded` into one of ours already set
    (vLLM-Omni's VAE decode) has its keys checked, and the first one's win."""
    for key in stage:
        if key not in STAGE_KEYS:
            _refuse(path, str(key), "not a stage key of vLLM-Omni's stage config")
    _runtime(stage.get("runtime", {}), [] if folded else mine, f"{path}.runtime")
    _edges(stage, mine, path, names_of, folded, async_chunk)
    for key, value in stage.get("engine_args", {}).items():
        if key not in IGNORED:   # onto the stage that vLLM-Omni's one stands for first
            _engine_key(None if folded else mine[0], str(key), value, f"{path}.engine_args")
    if "default_sampling_params" in stage:
        _sampling(stage["default_sampling_params"], mine[0], folded,
                  f"{path}.default_sampling_params")


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


def _func_adapter(func: object, path: str, key: str) -> str | None:
    name = str(func).rsplit(".", 1)[-1].removesuffix("_async_chunk")
    if name not in PROCESS_FUNCS:
        _refuse(path, key, f"{func!r}: no adapter here does what it does (known: "
                f"{', '.join(PROCESS_FUNCS)})")
    return PROCESS_FUNCS[name]


def _edges(stage: Mapping, mine: list[dict], path: str,
           names_of: dict[object, tuple[str, ...]], folded: bool, async_chunk: object) -> None:
    first, own = mine[0], {s["name"] for s in mine}
    engine = stage.get("engine_args", {})
    sources = stage.get("engine_input_source", [])
    got = [names_of[s][-1] if s in names_of else f"stage {s}" for s in sources]
    got = [g for g in got if g not in own]   # an edge inside a folded stage
    expected = [] if folded else [inp["from"] for inp in first.get("inputs", [])]
    if got != expected:
        _refuse(path, "engine_input_source", f"{sources}: {first['name']} reads "
                f"{expected or 'the prompt'} here (got {got})")
    if "custom_process_next_stage_input_func" in engine:
        _func_adapter(engine["custom_process_next_stage_input_func"], f"{path}.engine_args",
                      "custom_process_next_stage_input_func")
    func = stage.get("custom_process_input_func")
    if func is not None:
        adapter = _func_adapter(func, path, "custom_process_input_func")
        if (adapter is None) != folded or not (folded or first.get("inputs")):
            _refuse(path, "custom_process_input_func", f"{func!r}: stage {first['name']} "
                    "here has no such edge")
        for inp in [] if folded else first["inputs"]:
            inp["adapter"] = adapter
    chunk = engine.get("async_chunk", engine.get("async_chunk_stream", async_chunk))
    if chunk is not None and not folded:
        for inp in first.get("inputs", []):
            inp["chunked"] = bool(chunk)


def _final(group: list[tuple[int, Mapping]], last: dict, where: str) -> None:
    """The vLLM-Omni stages whose output our stage `last` makes: one saying final_output must
    say ours; a non-AR final stage of ours can't be told it is not final."""
    for i, stage in group:
        kind = stage.get("final_output_type", last.get("final"))
        if stage.get("final_output") and (kind != last.get("final") or kind is None):
            _refuse(f"{where}: stage_args[{i}]", "final_output_type", f"{kind!r}: stage "
                    f"{last['name']} makes {last.get('final')!r} here")
    said = [stage.get("final_output") for _, stage in group]
    if last.get("final") and last["kind"] != "ar" and False in said and True not in said:
        i = group[said.index(False)][0]
        _refuse(f"{where}: stage_args[{i}]", "final_output", f"false: stage {last['name']}'s "
                f"output is the graph's {last['final']} output here")


def _engine_key(s: dict | None, key: str, value: object, path: str) -> None:
    """Set engine_args' `key` on our stage `s` (None: only check it)."""
    if key in ONLY_VALUE:
        if value != ONLY_VALUE[key]:
            _refuse(path, key, f"{value!r}: only {ONLY_VALUE[key]} runs here")
        return
    if key not in ENGINE_KEYS:
        _refuse(path, key, "not supported here (no counterpart in the stage graph; see "
                "docs/migration-vllm-omni.md)")
    keys = list(ENGINE_KEYS[key])
    if not keys or s is None:
        return
    if keys[0] == "*":
        keys[0] = s["kind"]
    if keys[0] == "ar" and s["kind"] != "ar":
        return   # e.g. enforce_eager on code2wav: no CUDA graph switch of that kind here
    node = s
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value


def _sampling(params: object, stage: dict, folded: bool, path: str) -> None:
    if not isinstance(params, Mapping):
        raise ConfigError(f"{path}: expected a mapping")
    what, known = (("diffusion", DIFFUSION_SAMPLING_KEYS) if stage["kind"] == "diffusion"
                   else ("sampling", SAMPLING_KEYS))
    for key in params:
        if key not in known:
            _refuse(path, str(key), f"not a {what} parameter here (known: "
                    f"{', '.join(sorted(known))})")
    if stage["kind"] != "ar" or folded:
        # a vocoder samples nothing; a DiT's request parameters are the request's own (or the
        # pipeline's defaults), never the stage's
        return
    sampling = stage.setdefault("ar", {}).setdefault("sampling", {})
    for key, value in params.items():
        if key == "seed":
            stage["ar"]["seed"] = value
        elif not (key == "top_k" and value == -1):
            sampling[key] = value
