"""Graph-level rules and queries of a `GraphConfig`: names, edges, cycles, adapters, finals.

Adapter names are checked against the registry the caller passes (`adapters`: the stages
package's, `stages.adapters.registered()`, which the orchestrator passes); without one, only
their place in the graph is.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Collection, Iterable

from omnistage.configs.parse import ConfigError, apply_overrides, load_graph_yaml
from omnistage.configs.schema import GraphConfig, OutputKind, StageConfig, StageInput


def _hint(word: str, choices: Iterable[str]) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {match[0]}?)" if match else ""


def validate_graph(graph: GraphConfig, *, adapters: Collection[str] | None = None) -> None:
    """Raise ConfigError (message starting with the path) if the graph cannot run as written;
    `adapters`: the registered adapter names, if they are to be checked."""
    if not graph.stages:
        raise ConfigError("stages: at least one stage is required")
    index: dict[str, int] = {}
    for i, s in enumerate(graph.stages):
        if s.name in index:
            raise ConfigError(f"stages[{i}].name: {s.name!r} is already the name of "
                              f"stages[{index[s.name]}]")
        index[s.name] = i
    for i, s in enumerate(graph.stages):
        _check_inputs(graph, i, s, index, adapters)
    cycle = find_cycle(graph)
    if cycle:
        raise ConfigError(f"stages: cycle: {' -> '.join(cycle)}")
    if not entry_stages(graph):  # unreachable without a cycle; kept as a guard
        raise ConfigError("stages: no entry stage (one without inputs)")
    _check_outputs(graph)
    for i, s in enumerate(graph.stages):
        _check_kind(i, s)


def _check_inputs(graph: GraphConfig, i: int, s: StageConfig, index: dict[str, int],
                  adapters: Collection[str] | None) -> None:
    seen: set[str] = set()
    for j, inp in enumerate(s.inputs):
        path = f"stages[{i}].inputs[{j}]"
        if inp.source == s.name:
            raise ConfigError(f"{path}.from: stage {s.name!r} reads its own output (self-loop)")
        if inp.source not in index:
            raise ConfigError(f"{path}.from: no stage named {inp.source!r}"
                              f"{_hint(inp.source, index)} (stages: {', '.join(index)})")
        if inp.source in seen:
            raise ConfigError(f"{path}.from: {inp.source!r} is already an input of {s.name!r}")
        seen.add(inp.source)
        if adapters is not None and inp.adapter not in adapters:
            known = ", ".join(sorted(adapters)) or "none"
            raise ConfigError(f"{path}.adapter: {inp.adapter!r} is not registered"
                              f"{_hint(inp.adapter, adapters)} (known: {known}; stage "
                              f"{s.name!r})")


def _check_outputs(graph: GraphConfig) -> None:
    if all(s.final is None for s in graph.stages):
        raise ConfigError("stages: no final stage (set `final: text|audio|...` on the stage "
                          "whose output goes to the client)")
    producer: dict[str, str] = {}
    consumed = {inp.source for s in graph.stages for inp in s.inputs}
    for i, s in enumerate(graph.stages):
        if s.final is None and s.name not in consumed:
            raise ConfigError(f"stages[{i}]: the output of {s.name!r} goes nowhere (no `final` "
                              "and no stage reads it)")
        if s.final is not None and s.final in producer:
            raise ConfigError(f"stages[{i}].final: {s.final!r} is already the final output "
                              f"of stage {producer[s.final]!r}")
        if s.final is not None:
            producer[s.final] = s.name


def _check_kind(i: int, s: StageConfig) -> None:
    try:
        s.default_sampling()
    except ValueError as e:  # normally caught when the stage is built; kept as a guard
        raise ConfigError(f"stages[{i}].ar.{e}") from None


def find_cycle(graph: GraphConfig) -> list[str] | None:
    """A cycle as stage names in data-flow order, first name repeated at the end; else None."""
    consumers: dict[str, list[str]] = {s.name: [] for s in graph.stages}
    for s in graph.stages:
        for inp in s.inputs:
            if inp.source in consumers:
                consumers[inp.source].append(s.name)
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for nxt in consumers[name]:
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[name] = 2
        return None

    for s in graph.stages:
        if s.name not in state and (cycle := visit(s.name)):
            return cycle
    return None


def topological_order(graph: GraphConfig) -> list[str]:
    """Stage names, every stage after all of its inputs; ties keep the declared order."""
    order: list[str] = []
    done: set[str] = set()
    while len(order) < len(graph.stages):
        before = len(order)
        for s in graph.stages:  # a stage may follow one declared earlier in the same pass
            if s.name not in done and all(i.source in done for i in s.inputs):
                order.append(s.name)
                done.add(s.name)
        if len(order) == before:
            cycle = find_cycle(graph)
            why = f"cycle: {' -> '.join(cycle)}" if cycle else "an input names no stage"
            raise ConfigError(f"stages: no order exists ({why})")
    return order


def entry_stages(graph: GraphConfig) -> list[str]:
    """Names of the stages without inputs: they take the client's prompt."""
    return [s.name for s in graph.stages if not s.inputs]


def main_stage(graph: GraphConfig) -> StageConfig:
    """The stage vLLM's engine flags and keywords mean (`--max-model-len`,
    `gpu_memory_utilization=`): the first AR stage (an LLM's `llm`, Qwen3-Omni's thinker), else
    the diffusion stage that makes the output, else the first stage."""
    for pick in (lambda s: s.kind == "ar", lambda s: s.kind == "diffusion" and s.final,
                 lambda s: True):
        found = [s for s in graph.stages if pick(s)]
        if found:
            return found[0]
    raise ValueError("the stage graph has no stages")


PARALLEL_KEYS = ("tensor_parallel_size", "ulysses_degree", "ring_degree", "cfg_parallel_size")
# each parallel flag / keyword (vLLM's name) -> its field of `ParallelSizes`
PARALLEL_AXES = dict(zip(PARALLEL_KEYS, ("tp", "ulysses", "ring", "cfg")))


def parallel_devices_override(stage: StageConfig, sizes: dict[str, int]) -> str | None:
    """`STAGE.placement.devices=[...]` when parallel sizes set on `stage` (vLLM's names, e.g.
    tensor_parallel_size -> value) need more devices than it lists: consecutive ones from its
    first, as `-tp 2` means GPUs 0 and 1 to a vLLM user. None when its devices suffice (an
    explicit override still wins after)."""
    world = 1
    for key, axis in PARALLEL_AXES.items():
        world *= int(sizes.get(key, getattr(stage.parallel, axis)))
    devices = stage.placement.devices
    if world <= len(devices):
        return None
    return f"{stage.name}.placement.devices={list(range(devices[0], devices[0] + world))}"


def downstream(graph: GraphConfig, name: str) -> list[tuple[StageConfig, StageInput]]:
    """The stages that read `name`'s output, each with the input (edge) through which it does."""
    if name not in graph.stage_names:
        raise ConfigError(f"no stage named {name!r}{_hint(name, graph.stage_names)}")
    return [(s, inp) for s in graph.stages for inp in s.inputs if inp.source == name]


def stages_needed(graph: GraphConfig, outputs: set[OutputKind]) -> set[str]:
    """The final stages producing `outputs` plus everything upstream of them. A text-only
    request on thinker -> talker -> code2wav needs only the thinker."""
    finals = {s.final: s.name for s in graph.stages if s.final is not None}
    missing = set(outputs) - finals.keys()
    if missing:
        produced = ", ".join(f"{k} ({v})" for k, v in finals.items()) or "nothing"
        raise ValueError(f"outputs: no stage produces {', '.join(sorted(missing))} "
                         f"(this graph produces: {produced})")
    needed: set[str] = set()
    todo = [s.name for s in graph.stages if s.final in outputs]
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo.extend(inp.source for inp in graph.stage(name).inputs)
    return needed


def load_graph(source: str | os.PathLike[str], overrides: Iterable[str] = (), *,
               adapters: Collection[str] | None = None) -> GraphConfig:
    """Parse a graph (YAML file or text), apply `--stage-override` items, validate."""
    graph = apply_overrides(load_graph_yaml(source), overrides)
    validate_graph(graph, adapters=adapters)
    return graph
