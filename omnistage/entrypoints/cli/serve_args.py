"""The flags of `omnistage serve`: the HTTP server's, and the engine's. Both are read off
the config tree, not written here: the server flags off `ServerSettings` (configs/server.py),
the engine flags (vLLM's names, each setting the stage key its help names; `stage_flags.py`
applies them) off the stage tree (configs/engine_flags.py)."""

from __future__ import annotations

import argparse
from typing import Any, get_args

from omnistage.configs.engine_flags import EngineFlag, engine_flags
from omnistage.configs.server import (API_KEY_ENV, GROUPS, LOG_LEVELS,  # noqa: F401
                                      ServerFlag, server_flags)
from omnistage.entrypoints.cli.flags import dtype_name

# a flag's value parser by the name its field's metadata gives (`meta(..., type="dtype")`)
VALUE_PARSERS = {"dtype": dtype_name}

def add_server_args(p: argparse.ArgumentParser) -> None:
    """The HTTP server's flags, read off `ServerSettings`' fields (configs/server.py), in three
    parts: address and access, request limits, stores and logs; plus the few flags of the
    server process that set no settings field (the key file, TLS, uvicorn's log level)."""
    g = p.add_argument_group("server")
    for group in GROUPS:
        for flag in server_flags():
            if flag.group == group:
                add_server_flag(g, flag)
        _add_process_args(g, group)


def add_server_flag(g: argparse._ActionsContainer, flag: ServerFlag) -> None:
    """One flag read off a `ServerSettings` field: its type from the field's, its help, metavar
    and choices from the field's metadata; `append` and `comma` values become tuples in
    `ServerSettings.from_namespace`."""
    kw: dict[str, Any] = {"dest": flag.field, "default": flag.default, **flag.argparse}
    if flag.help:
        kw["help"] = flag.help
    if flag.value in ("store_true", "store_false", "append"):
        kw["action"] = flag.value
    elif flag.value == "extend":                  # vLLM's nargs="+": several values a flag
        kw.update(action="extend", nargs="+")
    else:
        kw["type"] = _scalar(flag.hint)
    g.add_argument(flag.flag, **kw)


def _add_process_args(g: argparse._ActionsContainer, group: str) -> None:
    """The server process's flags that are no settings field (serve.py reads them)."""
    if group == "access":
        g.add_argument("--api-key-file", default=None, metavar="FILE",
                       help="read the API key from FILE (its first line)")
        g.add_argument("--ssl-certfile", default=None, metavar="FILE",
                       help="serve HTTPS with this PEM certificate (and --ssl-keyfile)")
        g.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                       help="private key of --ssl-certfile (not needed if the certificate "
                            "file holds it)")
    elif group == "stores":
        g.add_argument("--uvicorn-log-level", default=None, choices=[*LOG_LEVELS, "trace"],
                       help="log level of uvicorn, the HTTP server (default: --log-level)")


def add_backend_args(g: argparse._ActionsContainer) -> None:
    """Where the stages run: the graph's `backend` and `ray_address` keys."""
    g.add_argument("--worker-backend", default=None, choices=["process", "ray"],
                   help="backend: process (one process per stage, this host; the default) or "
                        "ray (one Ray actor per stage rank, on any node of a Ray cluster)")
    g.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="ray_address: the Ray cluster to join (default: RAY_ADDRESS or the "
                        "one `ray start` runs here, else a new local cluster)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("graph")
    g.add_argument("--stage-config", default=None,
                   help="stage-graph YAML (or a packaged graph's name) replacing the model "
                        "type's default graph")
    g.add_argument("--stage-configs-path", default=None, metavar="FILE",
                   help="a vLLM-Omni stage config (stage_args YAML), translated to the stage "
                        "graph (docs/migration-vllm-omni.md)")
    g.add_argument("--stage-override", action="append", default=[], metavar="STAGE.KEY=VALUE",
                   help="change one field of the graph, e.g. llm.ar.max_num_seqs=8 (repeatable; "
                        "wins over the engine flags below)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add_backend_args(g)
    g.add_argument("--omni", action="store_true",
                   help="vLLM-Omni's `vllm serve MODEL --omni`: every model is served as the "
                        "graph of stages it is; with --api-dialect auto, answers that a request "
                        "cannot tell come in vLLM-Omni's shapes")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM compatibility; changes nothing: omnistage runs its "
                        "own model code, never code from a checkpoint")
    g.add_argument("--enable-lora", action="store_true",
                   help="accepted for vLLM compatibility; changes nothing: an image model's "
                        "diffusion stage takes LoRA adapters without it (--lora-modules)")
    e = p.add_argument_group("engine (main stage; each sets the stage key named)")
    for flag in engine_flags():
        if flag.cli:
            add_engine_flag(e, flag)


def add_engine_flag(g: argparse._ActionsContainer, flag: EngineFlag) -> None:
    """One flag read off the config tree: its type from the field's, its help the field's
    (`configs/records.py` `meta`), prefixed by the keys it sets."""
    extra = dict(flag.argparse)
    names = [extra.pop("short"), flag.flag] if "short" in extra else [flag.flag]
    action = extra.pop("action", None)
    keys = " / ".join(dict.fromkeys(flag.paths.values()))
    scope = ("every stage" if flag.every_stage else "main stage") + ": " + ", ".join(flag.kinds)
    kw: dict[str, Any] = {"default": None, "dest": flag.name,
                          "help": f"{keys}: {flag.help} ({scope})"}
    if action == "store_true":
        kw["action"] = "store_true"
    elif action == "bool_optional":
        kw["action"] = argparse.BooleanOptionalAction
    else:
        parser = extra.pop("type", None)
        kw["type"] = VALUE_PARSERS[parser] if parser else _scalar(flag.hint)
    g.add_argument(*names, **kw, **extra)


def _scalar(hint: Any) -> type:
    """The argparse type of a field's hint: int, float or str (`int | None` -> int)."""
    for tp in (int, float):
        if hint is tp or tp in get_args(hint):
            return tp
    return str
