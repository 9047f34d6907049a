"""The flags of `omnistage serve`: the HTTP server's, and the engine's. The engine flags
(vLLM's names, each setting the stage key its help names; `stage_flags.py` applies them) are
read off the config tree (configs/engine_flags.py), not written here."""

from __future__ import annotations

import argparse
from typing import Any, get_args

from omnistage.configs.engine_flags import EngineFlag, engine_flags
from omnistage.entrypoints.cli.flags import dtype_name

# a flag's value parser by the name its field's metadata gives (`meta(..., type="dtype")`)
VALUE_PARSERS = {"dtype": dtype_name}

LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]
API_KEY_ENV = "OMNISTAGE_API_KEY"     # the API key when no flag gives it (not seen in `ps`)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The HTTP server's own flags (not read off the config tree: they are `ServerConfig`'s,
    the front door's), in three parts: address and access, request limits, stores and logs."""
    g = p.add_argument_group("server")
    _add_access_args(g)
    _add_limit_args(g)
    _add_store_args(g)


def _add_access_args(g: argparse._ActionsContainer) -> None:
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; in a "
                        "container, or to accept other machines, use --host 0.0.0.0)")
    g.add_argument("--port", type=int, default=8000, help="checked free before the model loads")
    g.add_argument("--served-model-name", default=None,
                   help="the name clients send as `model` (default: MODEL as given, or "
                        "omnistage-demo)")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every route but /health and "
                        "the playground page (visible in `ps`: prefer --api-key-file or "
                        f"${API_KEY_ENV})")
    g.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="read the API key from FILE (its first line)")
    g.add_argument("--open-metrics", dest="open_metrics", action="store_true", default=None,
                   help="serve /metrics without the API key (for a Prometheus scraper)")
    g.add_argument("--header-timeout", dest="header_timeout_s", type=float, default=None,
                   metavar="SECONDS", help="a connection whose request headers are not complete "
                   "this long after it opened (or after its last response) is closed "
                   "(default 10)")
    g.add_argument("--body-timeout", dest="body_timeout_s", type=float, default=None,
                   metavar="SECONDS", help="a request body not fully received this long after "
                   "the request started gets 408 (default 60)")
    g.add_argument("--max-connections-per-client", type=int, default=None, metavar="N",
                   help="connections one client address may hold open; more are answered 429 "
                        "and closed (default 64; 0: no cap, e.g. behind a reverse proxy)")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="serve HTTPS with this PEM certificate (and --ssl-keyfile)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                   help="private key of --ssl-certfile (not needed if the certificate file "
                        "holds it)")


def _add_limit_args(g: argparse._ActionsContainer) -> None:
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests in flight before new ones get 429 + Retry-After")
    g.add_argument("--allowed-media-dirs", action="append", default=[], metavar="DIR",
                   help="a folder whose files requests may name as file:// media URLs "
                        "(repeatable)")
    g.add_argument("--allow-remote-media", action="store_true",
                   help="let requests name http(s) media URLs (the server fetches them)")
    g.add_argument("--max-body-bytes", type=int, default=64 << 20,
                   help="largest request body (413 above)")
    g.add_argument("--max-media-bytes", type=int, default=20 << 20,
                   help="largest image / audio / video a request may carry or name")
    g.add_argument("--max-image-pixels", type=int, default=None, metavar="N",
                   help="pixels of one input image or video frame, read from its header "
                        "before decoding (400 above; default 33554432)")
    g.add_argument("--max-request-pixels", type=int, default=None, metavar="N",
                   help="pixels of all input images and sampled video frames of a request "
                        "(default 67108864)")
    g.add_argument("--max-audio-seconds", type=float, default=None, metavar="S",
                   help="seconds of all input audio of a request, read from the headers "
                        "first (default 300)")
    g.add_argument("--max-input-video-frames", type=int, default=None, metavar="N",
                   help="frames sampled from one input video (default 256)")
    g.add_argument("--max-media-parts", type=int, default=None, metavar="N",
                   help="image / audio / video parts of one chat request (default 16)")
    g.add_argument("--max-message-parts", type=int, default=None, metavar="N",
                   help="content parts of one chat message (default 64)")
    g.add_argument("--prep-workers", type=int, default=None, metavar="N",
                   help="threads preparing requests off the event loop: media decoding, chat "
                        "templates, tokenization (default 4)")
    g.add_argument("--max-pending-prep", type=int, default=None, metavar="N",
                   help="requests queued or being prepared before new ones get 429 "
                        "(default 64)")
    g.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGIN",
                   help="a CORS origin allowed to call the API, or * (repeatable; default: "
                        "no CORS)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template (a file, or the template text) replacing the "
                        "tokenizer's own; text models only")
    g.add_argument("--default-modalities", default=None, metavar="LIST",
                   help="what a chat answers with when a request names no `modalities`, e.g. "
                        "text,audio as vLLM-Omni does for omni models (default: text, as "
                        "OpenAI; image for an image model)")


def _add_store_args(g: argparse._ActionsContainer) -> None:
    g.add_argument("--voices-dir", default=None, metavar="DIR",
                   help="where POST /v1/audio/voices keeps uploaded voices; they survive a "
                        "restart (default: ~/.cache/omnistage/voices, or under $XDG_CACHE_HOME)")
    g.add_argument("--videos-dir", default=None, metavar="DIR",
                   help="where /v1/videos keeps its jobs (SQLite) and files; they survive a "
                        "restart (default: ~/.cache/omnistage/videos, or under $XDG_CACHE_HOME)")
    g.add_argument("--videos-scope", default=None, metavar="NAME",
                   help="whose jobs in the videos folder this server sees: servers with the "
                        "same scope share them (replicas behind one balancer); default: one "
                        "scope per served model and address (host:port; and machine, in the "
                        "default folder), so a restart with the same flags keeps its jobs")
    g.add_argument("--max-video-jobs", type=int, default=None, metavar="N",
                   help="video jobs queued or running at most (429 above; default 64)")
    g.add_argument("--max-video-frames", type=int, default=None, metavar="N",
                   help="frames a video may have, below the model's own maximum (default 241)")
    g.add_argument("--max-video-size", type=int, default=None, metavar="PIXELS",
                   help="longest side of a video (default 1920)")
    g.add_argument("--max-videos-disk-bytes", type=int, default=None, metavar="BYTES",
                   help="disk the stored videos may take; beyond it new jobs get 429 until "
                        "some are deleted (default 20 GiB)")
    g.add_argument("--max-running-videos", type=int, default=None, metavar="N",
                   help="video jobs the engine runs at once (default 1)")
    g.add_argument("--realtime-max-buffer-bytes", type=int, default=None, metavar="BYTES",
                   help="input audio a /v1/realtime session may hold uncommitted (PCM16 at "
                        "16 kHz; default 15 MiB)")
    g.add_argument("--realtime-max-turn", dest="realtime_max_turn_s", type=float, default=None,
                   metavar="SECONDS", help="longest user turn of a realtime session: voice "
                   "detection cuts it there, a longer commit is refused (default 60)")
    g.add_argument("--realtime-idle-timeout", dest="realtime_idle_timeout_s", type=float,
                   default=None, metavar="SECONDS",
                   help="a realtime session with no client event this long is closed "
                        "(default 600)")
    g.add_argument("--stats-log-interval", dest="stats_log_interval_s", type=float,
                   default=None, metavar="SECONDS",
                   help="log each stage's stats line at most this often, when it changed "
                        "(default 10; 0: never)")
    g.add_argument("--no-playground", dest="enable_playground", action="store_false",
                   default=None, help="serve no playground page at / (default: the page, "
                                      "whose tabs follow what the model can do)")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS)
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
                   help="accepted for vLLM-Omni compatibility (`vllm serve MODEL --omni`); "
                        "changes nothing: every model is served as the graph of stages it is")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM compatibility; changes nothing: omnistage runs its "
                        "own model code, never code from a checkpoint")
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
