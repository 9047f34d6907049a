"""The stage graph from YAML (a file, or the text itself) and from `--stage-override` items,
parsed strictly by strict.py into schema.py's `GraphConfig`. `ConfigError`, `from_dict`,
`to_dict` and `load_yaml` are strict.py's, importable from here too."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omnistage.configs.schema import GraphConfig
from omnistage.configs.strict import (ConfigError, _join, _type_name, from_dict,  # noqa: F401
                                      load_yaml, to_dict)


def _read_source(source: str | os.PathLike[str]) -> tuple[str, str]:
    """(text, name): `source` is a path if it is PathLike, or a one-line string that names an
    existing file or ends in .yaml/.yml; otherwise it is the YAML text itself."""
    is_path = isinstance(source, os.PathLike) or (
        "\n" not in source and (source.endswith((".yaml", ".yml")) or Path(source).is_file()))
    if not is_path:
        return str(source), ""
    try:
        return Path(source).read_text(), str(source)
    except OSError as e:
        raise ConfigError(f"{source}: cannot read ({e.strerror or e})") from None


def load_graph_yaml(source: str | os.PathLike[str]) -> GraphConfig:
    """Parse a graph YAML file (or YAML text) strictly. Graph rules: `graph.validate_graph`."""
    text, name = _read_source(source)
    data = load_yaml(text, name)
    if not isinstance(data, Mapping):
        where = f"{name}: top level" if name else "top level"
        raise ConfigError(f"{where}: expected a mapping with a 'stages' list, "
                          f"got {_type_name(data)}")
    return from_dict(GraphConfig, data)


# ---- command-line overrides --------------------------------------------------------------------

def apply_overrides(graph: GraphConfig, overrides: Iterable[str]) -> GraphConfig:
    """Apply `--stage-override` items in order: `NAME.KEY=VALUE` for a stage (nested keys like
    `talker.ar.sampling.temperature=0.9`, list items like `talker.inputs.0.chunked=false`) or
    `KEY=VALUE` for the graph (`connector=tcp`). VALUE is YAML (`0.2`, `true`, `[0, 1]`).
    The result is rebuilt by the same strict parser as the YAML file."""
    for item in overrides:
        graph = _apply_one(graph, item)
    return graph


def _apply_one(graph: GraphConfig, item: str) -> GraphConfig:
    lhs, eq, rhs = item.partition("=")
    lhs = lhs.strip()
    parts = lhs.split(".")
    if not eq or not all(parts):
        raise ConfigError(f"{item!r}: expected NAME.KEY=VALUE (a stage) or KEY=VALUE (the graph)")
    value = load_yaml(rhs, f"{lhs}: value {rhs!r}")
    data = to_dict(graph)
    names = [s["name"] for s in data["stages"]]
    prefix = ""
    if parts[0] in names:
        if len(parts) == 1:
            raise ConfigError(f"{lhs}: expected {lhs}.KEY=VALUE to override a key of the stage")
        i = names.index(parts[0])
        node, keys, prefix = data["stages"][i], parts[1:], f"stages[{i}]"
    elif parts[0] in data:
        node, keys = data, parts
    else:
        hint = difflib.get_close_matches(parts[0], names + list(data), n=1)
        raise ConfigError(
            f"{lhs}: {parts[0]!r} is neither a stage nor a graph key"
            + (f" (did you mean {hint[0]}?)" if hint else "")
            + f" (stages: {', '.join(names)}; graph keys: {', '.join(data)})")
    base = len(parts) - len(keys)
    for depth, key in enumerate(keys):
        where = ".".join(parts[:base + depth])
        if depth == len(keys) - 1:
            _set(node, key, value, where, lhs)
        else:
            node = _child(node, key, where, lhs)
    try:
        return from_dict(type(graph), data)
    except ConfigError as e:
        msg = str(e)
        if prefix:  # the stage's name for its index, also in a moved key's new path
            msg = msg.replace(prefix + ".", parts[0] + ".").replace(prefix + ":", parts[0] + ":")
        raise ConfigError(f"{msg} [override {item!r}]") from None


def _index(node: list, key: str, where: str, lhs: str) -> int:
    if not key.isdigit() or int(key) >= len(node):
        raise ConfigError(f"{lhs}: {where} is a list of {len(node)}; {key!r} is not an index")
    return int(key)


def _child(node: Any, key: str, where: str, lhs: str) -> Any:
    if isinstance(node, list):
        return node[_index(node, key, where, lhs)]
    if key not in node or node[key] is None:
        node[key] = {}  # an unknown key: the strict parser names it, with a hint
    child = node[key]
    if not isinstance(child, (dict, list)):
        raise ConfigError(f"{lhs}: {_join(where, key)} is a {_type_name(child)}, "
                          "it has no keys to set")
    return child


def _set(node: Any, key: str, value: object, where: str, lhs: str) -> None:
    if isinstance(node, list):
        node[_index(node, key, where, lhs)] = value
    else:
        node[key] = value
