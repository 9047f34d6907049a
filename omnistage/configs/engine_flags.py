"""The engine flags and keywords, read off the config tree: a field whose metadata names a
`flag` (records.py `meta`) becomes `omnistage serve --<flag>` and `Omni(<flag>=...)`, setting
that field of the main stage (or of every stage, where it says so).

    ARSettings.max_num_seqs        meta(flag="max_num_seqs")   -> --max-num-seqs: ar.max_num_seqs
    DiffusionSettings.max_num_seqs meta(flag="max_num_seqs")   ->   ... or diffusion.max_num_seqs

One flag may set a field of several records (the batch size of an ar and of a diffusion stage):
it keeps one path per stage kind. `fields_of` walks the same tree for the configuration
reference (scripts/config_doc.py). Nothing here imports torch: `serve --help` builds on it.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints

from omnistage.configs.records import ALL_KINDS, StageKind
from omnistage.configs.schema import GraphConfig, StageConfig


@dataclass(frozen=True, slots=True)
class EngineFlag:
    name: str                          # vLLM's name: the keyword, the flag with dashes
    paths: dict[StageKind, str]        # stage kind -> the field it sets, e.g. "ar.max_num_seqs"
    help: str
    hint: Any                          # the field's type hint
    every_stage: bool                  # the flag sets every stage of its kinds, not the main one
    keyword_every_stage: bool          # the same, for the Omni keyword
    cli: bool                          # `serve` has the flag
    keyword: bool                      # `Omni` takes the keyword
    argparse: dict[str, Any]           # metavar, short, action, choices, type ("dtype")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def kinds(self) -> tuple[StageKind, ...]:
        return tuple(self.paths)


@dataclass(frozen=True, slots=True)
class FieldDoc:
    """One field of the tree, for the reference page."""

    path: str                          # "stages[].ar.kv_cache.block_size"
    hint: Any
    default: object                    # dataclasses.MISSING: required
    help: str
    flag: str | None                   # "--max-num-seqs" (or only "Omni(block_size=)") sets it


def record_of(hint: Any) -> type | None:
    """The dataclass a field holds (`ARSettings | None` -> ARSettings), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    if get_origin(hint) in (Union, types.UnionType):
        found = [a for a in get_args(hint) if dataclasses.is_dataclass(a)]
        return found[0] if found else None
    return None


def _walk(cls: type, prefix: str, kinds: tuple[StageKind, ...]
          ) -> list[tuple[str, dataclasses.Field, Any, tuple[StageKind, ...]]]:
    """(path, field, hint, kinds that read it) of every field under `cls`, depth first."""
    out = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = prefix + f.metadata.get("alias", f.name)
        out.append((path, f, hints[f.name], kinds))
        sub = record_of(hints[f.name])
        if sub is not None:
            below = (f.name,) if f.name in ALL_KINDS else kinds
            out += _walk(sub, path + ".", below)  # type: ignore[arg-type]
    return out


@functools.cache
def engine_flags() -> tuple[EngineFlag, ...]:
    """Every flag of the stage tree, in field order; one per name."""
    found: dict[str, EngineFlag] = {}
    for path, f, hint, kinds in _walk(StageConfig, "", ALL_KINDS):
        spec = f.metadata.get("flag")
        if spec is None:
            continue
        kinds = spec["kinds"] or kinds
        old = found.get(spec["name"])
        paths = {**(old.paths if old else {}), **{k: path for k in kinds}}
        found[spec["name"]] = EngineFlag(
            spec["name"], paths, old.help if old else f.metadata["help"], hint,
            spec["every_stage"], spec["keyword_every_stage"], spec["cli"], spec["keyword"],
            dict(spec["argparse"]))
    return tuple(found.values())


def flag_named(name: str) -> EngineFlag | None:
    return next((f for f in engine_flags() if f.name == name), None)


def fields_of(cls: type = StageConfig, prefix: str = "") -> list[FieldDoc]:
    """The reference rows of `cls` (default: a stage) and of every record under it."""
    by_path = {p: f.flag if f.cli else f"Omni({f.name}=)" for f in engine_flags()
               for p in f.paths.values()}
    rows = []
    for path, f, hint, _ in _walk(cls, "", ALL_KINDS):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
        rows.append(FieldDoc(prefix + path, hint, default, f.metadata.get("help", ""),
                             by_path.get(path) if cls is StageConfig else None))
    return rows


def stage_items(graph: GraphConfig, flag: EngineFlag, value: object, *, main: StageConfig,
                every_stage: bool) -> list[tuple[str, object]]:
    """(`STAGE.PATH`, value) for one flag or keyword: on every stage of its kinds, or on the
    main stage (whose kind the caller checked)."""
    targets = [s for s in graph.stages if s.kind in flag.paths] if every_stage else [main]
    return [(f"{s.name}.{flag.paths[s.kind]}", value) for s in targets]
