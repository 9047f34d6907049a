"""Strict parsing of plain data (YAML, command-line values) into frozen config dataclasses.

`from_dict` is driven by dataclass fields and their type hints. Every error is a `ConfigError`
whose message starts with the path of the offending value, e.g.
`stages[1].ar.max_num_seq: unknown key (did you mean max_num_seqs?)`; a key that moved into
a sub-record names its new place (`stages[0].max_num_seqs: moved to stages[0].ar.max_num_seqs`). A field may be spelled
differently in YAML through its metadata: `field(metadata={"alias": "from"})`.

This module knows no config class: schema.py builds on it, and parse.py (the graph from YAML
and `--stage-override` items) on both, so the three form no import circle.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem; the message starts with the path of the offending value."""


# ---- from_dict ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class _Spec:
    fields: dict[str, tuple[str, Any]]  # YAML key -> (attribute name, type hint)
    required: tuple[str, ...]  # YAML keys without a default
    aliased: dict[str, str]  # attribute name -> YAML key, where they differ


@functools.cache
def _spec(cls: type) -> _Spec:
    hints = get_type_hints(cls)
    fields: dict[str, tuple[str, Any]] = {}
    required: list[str] = []
    aliased: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f.metadata.get("alias", f.name)
        fields[key] = (f.name, hints[f.name])
        if key != f.name:
            aliased[f.name] = key
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(key)
    return _Spec(fields, tuple(required), aliased)


def from_dict(cls: type[T], data: object, path: str = "") -> T:
    """Build `cls` (a dataclass or any supported type hint) from plain data, strictly."""
    return _convert(cls, data, path)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _at(path: str, msg: str) -> ConfigError:
    return ConfigError(f"{path}: {msg}" if path else msg)


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _describe(tp: Any) -> str:
    """What a value of type hint `tp` looks like in YAML, for "expected ..." messages."""
    origin = get_origin(tp)
    if origin is Literal:
        kinds = {type(a) for a in get_args(tp)}
        return " or ".join(sorted({_describe(k) for k in kinds}))
    if origin in (Union, types.UnionType):
        return " or ".join(dict.fromkeys(_describe(a) for a in get_args(tp)))
    if tp in (tuple, list) or origin in (tuple, list):
        return "a list"
    if tp is dict or origin is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    names = {str: "a string", bool: "a boolean", int: "an integer", float: "a number",
             type(None): "null"}
    return names.get(tp, repr(tp))


def _accepts(tp: Any, value: object) -> bool:
    """Whether `value` has the right outer type for `tp` (used to pick a Union member)."""
    origin = get_origin(tp)
    if tp is Any or tp is object:
        return True
    if origin is Literal:
        return any(type(value) is type(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return any(_accepts(a, value) for a in get_args(tp))
    if tp in (tuple, list) or origin in (tuple, list):
        return isinstance(value, (list, tuple))
    if dataclasses.is_dataclass(tp):
        return isinstance(value, (Mapping, tp))
    if tp is dict or origin is dict:
        return isinstance(value, Mapping)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _convert(tp: Any, value: object, path: str) -> Any:
    origin = get_origin(tp)
    if tp is Any or tp is object:
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin is Literal:
        return _literal(tp, value, path)
    if origin in (Union, types.UnionType):
        return _union(tp, value, path)
    if not _accepts(tp, value):
        raise _at(path, f"expected {_describe(tp)}, got {_type_name(value)}")
    if tp in (tuple, list) or origin in (tuple, list):
        return _sequence(tp, value, path)
    if tp is dict or origin is dict:
        key_tp, value_tp = get_args(tp) or (str, Any)
        out = {}
        for k, v in value.items():
            if not _accepts(key_tp, k):
                raise _at(path, f"keys must be {_describe(key_tp)}, got {_type_name(k)} {k!r}")
            out[k] = _convert(value_tp, v, _join(path, str(k)))
        return out
    if tp is float:
        return float(value)
    if tp in (str, int, bool, type(None)):
        return value
    raise TypeError(f"{path}: unsupported type hint {tp!r}")


def _literal(tp: Any, value: object, path: str) -> Any:
    allowed = get_args(tp)
    for a in allowed:
        if type(value) is type(a) and value == a:
            return a
    if not _accepts(tp, value):
        raise _at(path, f"expected {_describe(tp)}, got {_type_name(value)}")
    hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    msg = f"{value!r} is not one of {', '.join(str(a) for a in allowed)}"
    raise _at(path, msg + (f" (did you mean {hint[0]}?)" if hint else ""))


def _union(tp: Any, value: object, path: str) -> Any:
    members = get_args(tp)
    if value is None:
        if type(None) in members:
            return None
        raise _at(path, f"expected {_describe(tp)}, got null")
    first: ConfigError | None = None
    for member in members:
        if member is type(None) or not _accepts(member, value):
            continue
        try:
            return _convert(member, value, path)
        except ConfigError as e:
            first = first or e
    if first is not None:
        raise first
    raise _at(path, f"expected {_describe(tp)}, got {_type_name(value)}")


def _sequence(tp: Any, value: Any, path: str) -> tuple | list:
    args = get_args(tp)
    if (len(args) == 2 and args[1] is Ellipsis) or get_origin(tp) is list:
        items = [_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    elif args:
        if len(value) != len(args):
            raise _at(path, f"expected a list of {len(args)} items, got {len(value)}")
        items = [_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
    else:
        items = list(value)
    return items if tp is list or get_origin(tp) is list else tuple(items)


def _unknown_key(cls: type, spec: _Spec, key: str, data: Mapping, path: str) -> str:
    # a class whose keys moved into sub-records names the new path (`moved_key(data, key)`)
    moved = getattr(cls, "moved_key", None)
    new = moved(data, key) if moved is not None else None
    if new is not None:
        return f"moved to {_join(path, new)}"
    if key in spec.aliased:
        return f"unknown key (did you mean {spec.aliased[key]}?)"
    hint = difflib.get_close_matches(key, list(spec.fields), n=1)
    if hint:
        return f"unknown key (did you mean {hint[0]}?)"
    new = moved(data, key, close=True) if moved is not None else None
    if new is not None:
        return f"unknown key (did you mean {new}?)"
    if not spec.fields:
        return "unknown key (it takes none)"
    return f"unknown key (known keys: {', '.join(spec.fields)})"


def _build(cls: type[T], value: object, path: str) -> T:
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise _at(path, f"expected a mapping, got {_type_name(value)}")
    spec = _spec(cls)
    kwargs: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise _at(path, f"keys must be strings, got {_type_name(key)} {key!r}")
        if key not in spec.fields:
            raise _at(_join(path, key), _unknown_key(cls, spec, key, value, path))
        name, tp = spec.fields[key]
        kwargs[name] = _convert(tp, item, _join(path, key))
    for key in spec.required:
        if spec.fields[key][0] not in kwargs:
            raise _at(path, f"missing required key {key!r}")
    try:
        return cls(**kwargs)
    except ValueError as e:  # __post_init__ checks; ConfigError included
        raise _post_init_error(cls, spec, path, str(e)) from None


def _post_init_error(cls: type, spec: _Spec, path: str, msg: str) -> ConfigError:
    """Prepend `path` to a __post_init__ message; one naming a field ("memory_fraction: ...",
    "SamplingParams.top_p=2: ...") extends the path with that field."""
    msg = msg.removeprefix(f"{cls.__name__}.")
    m = re.match(r"[A-Za-z_]\w*", msg)
    if m and m.group() in spec.fields and msg[m.end():m.end() + 1] in (".", "[", "=", ":"):
        return ConfigError(_join(path, msg))
    return _at(path, msg)


# ---- to_dict -----------------------------------------------------------------------------------

def to_dict(obj: object, *, omit_defaults: bool = False) -> Any:
    """The plain (YAML) form of a config object: the inverse of `from_dict`."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            value = getattr(obj, f.name)
            if omit_defaults and _is_default(f, value):
                continue
            out[f.metadata.get("alias", f.name)] = to_dict(value, omit_defaults=omit_defaults)
        return out
    if isinstance(obj, (tuple, list)):
        return [to_dict(v, omit_defaults=omit_defaults) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v, omit_defaults=omit_defaults) for k, v in obj.items()}
    return obj


def _is_default(f: dataclasses.Field, value: object) -> bool:
    if f.default is not dataclasses.MISSING:
        return value == f.default
    if f.default_factory is not dataclasses.MISSING:
        return value == f.default_factory()
    return False


# ---- YAML --------------------------------------------------------------------------------------

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and reads `1e-3` as a float (as YAML 1.2 does)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    seen: set[object] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, (str, int, float, bool)) or key is None:
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def load_yaml(text: str, where: str = "") -> Any:
    """Parse YAML text; errors name the line and column (`where` is prepended, e.g. a file)."""
    prefix = f"{where}: " if where else ""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        loc = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        context = f" ({e.context})" if e.context and e.problem else ""
        raise ConfigError(f"{prefix}{loc}{e.problem or e.context}{context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{prefix}invalid YAML: {e}") from None
