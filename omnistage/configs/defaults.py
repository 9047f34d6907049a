"""Which stage graph a model runs: the model type's default, or the user's own file, plus
command-line overrides. Engine keyword arguments (`max_num_seqs=8`, ...) become overrides of
every stage that has such a field."""

from __future__ import annotations

import json
from dataclasses import fields
from importlib import resources
from pathlib import Path


from omnistage import registry
from omnistage.configs.graph import load_graph
from omnistage.configs.parse import load_yaml
from omnistage.configs.schema import GraphConfig, StageConfig

_STAGE_FIELDS = {f.name for f in fields(StageConfig)}


def default_graph_text(model_path: Path | None) -> str:
    """The default graph of the family serving `model_path` (None: the built-in demo's)."""
    found = registry.family(registry.DEMO) if model_path is None else \
        registry.family_of_folder(model_path)
    if found.graph is None:
        raise ValueError(f"{model_path}: the {found.name!r} family ships no default graph "
                         "(pass stage_config)")
    return resources.files("omnistage.configs").joinpath(found.graph).read_text()


def packaged_graphs() -> list[str]:
    """Names of the graphs shipped in omnistage/configs/ (`flux`, `flux_split`, ...)."""
    return sorted(f.name.removesuffix(".yaml") for f in resources.files("omnistage.configs")
                  .iterdir() if f.name.endswith(".yaml"))


def stage_config_text(stage_config: str | Path) -> str:
    """`--stage-config` / `stage_config=` as YAML text: a file; else a packaged graph by name
    ("z_image_split" or "z_image_split.yaml", an existing file of that name wins); else YAML
    text itself. A one-line value without ':' is a name, never YAML: unknown, it is refused."""
    if _is_file(stage_config):
        return Path(stage_config).read_text()
    text = str(stage_config)
    if "\n" in text or ":" in text:
        return text
    name = text.removesuffix(".yaml")
    if name in packaged_graphs():
        return resources.files("omnistage.configs").joinpath(f"{name}.yaml").read_text()
    raise ValueError(f"stage_config {text!r}: no such file, and no packaged graph of that name "
                     f"(packaged: {', '.join(packaged_graphs())})")


def _is_file(value: str | Path) -> bool:
    """Whether `value` names a file; YAML text (several lines, maybe longer than a file name
    may be) never does."""
    return "\n" not in str(value) and Path(str(value)).is_file()


def resolve_graph(model: str | None, model_path: Path | None, stage_config: str | Path | None,
                  overrides: list[str] | tuple[str, ...] = (),
                  **engine_kw: object) -> GraphConfig:
    """The graph to run: `stage_config` (a file, the name of a packaged graph, or YAML text) or
    the model type's default, with `model` set, engine keyword arguments applied to every
    stage, then `overrides`."""
    if stage_config is not None:
        text = stage_config_text(stage_config)
        where = str(stage_config) if "\n" not in str(stage_config) else "stage_config"
    else:
        text, where = default_graph_text(model_path), "default graph"
    doc = load_yaml(text, where) or {}       # a syntax error names where, line and column
    stages = doc.get("stages", []) if isinstance(doc, dict) else []
    stage_names = [s.get("name") for s in stages if isinstance(s, dict)]
    extra: list[str] = []
    if model is not None:
        extra.append(f"model={json.dumps(model)}")
    for key, value in engine_kw.items():
        if value is None:
            continue
        if key in ("connector", "backend"):
            extra.append(f"{key}={value}")
        elif key in _STAGE_FIELDS:
            extra += [f"{name}.{key}={json.dumps(value)}" for name in stage_names]
        else:
            raise ValueError(f"unknown engine option {key!r}")
    return load_graph(text, [*extra, *overrides])
