"""The HTTP server's settings, each field with the flag of `omnistage serve` that sets it: the
flags are read off these fields (entrypoints/cli/serve_args.py), as the engine flags are read
off the stage tree (engine_flags.py). Nothing here imports torch or FastAPI: `serve --help`
builds on it. `api_server.ServerConfig` adds what the running server derives (limit records).

    max_queue: int = field(default=256, metadata=flag("requests in flight before ...",
                                                      group="limits", cli_default=True))
        -> --max-queue N (type int, default 256)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from omnistage.configs.lora_modules import parse_lora_modules

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
API_KEY_ENV = "OMNISTAGE_API_KEY"     # the API key when no flag gives it (not seen in `ps`)
GROUPS = ("access", "limits", "stores")
API_DIALECTS = ("auto", "openai", "vllm-omni")  # the order of the flags in `serve --help`


def flag(help: str, *, group: str, name: str | None = None, cli_default: bool = False,
         value: str = "scalar", **argparse_kw: Any) -> dict[str, Any]:
    """A server field's documentation and flag. `name`: the flag when it is not the field's
    name with dashes; `cli_default`: the flag's default is the field's (else None: unset, the
    field's default applies); `value`: how the CLI value maps, "scalar" (its type), "append"
    (a repeatable flag -> a tuple), "extend" (vLLM's nargs="+", repeatable too -> a tuple),
    "comma" (a comma list -> a tuple), "store_true",
    "store_false"; `argparse_kw`: metavar, choices."""
    return {"help": help, "server_flag": dict(group=group, name=name, cli_default=cli_default,
                                              value=value, argparse=argparse_kw)}


@dataclass(frozen=True, slots=True)
class ServerFlag:
    field: str                         # the ServerSettings field it sets (the argparse dest)
    flag: str                          # "--max-queue"
    group: str                         # one of GROUPS
    help: str
    default: object                    # the argparse default
    value: str                         # see `flag`
    hint: Any
    argparse: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The server's settings; every field but `model`, `vllm_omni_launch` and `stats_timeout_s`
    has a flag."""

    model: str | None = None
    # ---- address and access
    host: str = field(default="127.0.0.1", metadata=flag(
        "address to listen on (default 127.0.0.1: this machine only; in a container, or to "
        "accept other machines, use --host 0.0.0.0)", group="access", cli_default=True))
    port: int = field(default=8000, metadata=flag(
        "checked free before the model loads", group="access", cli_default=True))
    served_model_name: str | None = field(default=None, metadata=flag(
        "the name clients send as `model` (default: MODEL as given, or omnistage-demo)",
        group="access"))
    lora_modules: tuple[str, ...] = field(default=(), metadata=flag(
        "LoRA adapters of the diffusion stage loaded at start, vLLM's NAME=PATH or JSON "
        '{"name": ..., "path": ..., "base_model_name": ...} (several after one flag, or the '
        "flag repeated; requests choose one by `model` or `lora.name`: docs/lora.md)",
        group="access", value="extend", metavar="NAME=PATH"))
    api_key: str | None = field(default=None, metadata=flag(
        "require `Authorization: Bearer KEY` on every route but /health and the playground "
        f"page (visible in `ps`: prefer --api-key-file or ${API_KEY_ENV})", group="access"))
    open_metrics: bool = field(default=False, metadata=flag(
        "serve /metrics without the API key (for a Prometheus scraper)", group="access",
        value="store_true"))
    header_timeout_s: float = field(default=10.0, metadata=flag(
        "a connection whose request headers are not complete this long after it opened (or "
        "after its last response) is closed (default 10)", group="access",
        name="header_timeout", metavar="SECONDS"))
    body_timeout_s: float = field(default=60.0, metadata=flag(
        "a request body not fully received this long after the request started gets 408 "
        "(default 60)", group="access", name="body_timeout", metavar="SECONDS"))
    max_connections_per_client: int = field(default=64, metadata=flag(
        "connections one client address may hold open; more are answered 429 and closed "
        "(default 64; 0: no cap, e.g. behind a reverse proxy)", group="access", metavar="N"))
    # ---- request limits
    max_queue: int = field(default=256, metadata=flag(
        "requests in flight before new ones get 429 + Retry-After", group="limits",
        cli_default=True))
    allowed_media_dirs: tuple[str, ...] = field(default=(), metadata=flag(
        "a folder whose files requests may name as file:// media URLs (repeatable)",
        group="limits", value="append", metavar="DIR"))
    allow_remote_media: bool = field(default=False, metadata=flag(
        "let requests name http(s) media URLs (the server fetches them)", group="limits",
        value="store_true", cli_default=True))
    max_body_bytes: int = field(default=64 << 20, metadata=flag(
        "largest request body (413 above)", group="limits", cli_default=True))
    max_media_bytes: int = field(default=20 << 20, metadata=flag(
        "largest image / audio / video a request may carry or name", group="limits",
        cli_default=True))
    # what a request's media may take before anything is decoded (media.py; deployment.md)
    max_image_pixels: int = field(default=1 << 25, metadata=flag(
        "pixels of one input image or video frame, read from its header before decoding (400 "
        "above; default 33554432)", group="limits", metavar="N"))
    max_request_pixels: int = field(default=1 << 26, metadata=flag(
        "pixels of all input images and sampled video frames of a request (default 67108864)",
        group="limits", metavar="N"))
    max_audio_seconds: float = field(default=300.0, metadata=flag(
        "seconds of all input audio of a request, read from the headers first (default 300)",
        group="limits", metavar="S"))
    max_input_video_frames: int = field(default=256, metadata=flag(
        "frames sampled from one input video (default 256)", group="limits", metavar="N"))
    max_media_parts: int = field(default=16, metadata=flag(
        "image / audio / video parts of one chat request (default 16)", group="limits",
        metavar="N"))
    max_message_parts: int = field(default=64, metadata=flag(
        "content parts of one chat message (default 64)", group="limits", metavar="N"))
    # the preparation pool (prep_pool.py): threads, and requests queued or running there
    prep_workers: int = field(default=4, metadata=flag(
        "threads preparing requests off the event loop: media decoding, chat templates, "
        "tokenization (default 4)", group="limits", metavar="N"))
    max_pending_prep: int = field(default=64, metadata=flag(
        "requests queued or being prepared before new ones get 429 (default 64)",
        group="limits", metavar="N"))
    allowed_origins: tuple[str, ...] = field(default=(), metadata=flag(
        "a CORS origin allowed to call the API, or * (repeatable; default: no CORS)",
        group="limits", value="append", metavar="ORIGIN"))
    chat_template: str | None = field(default=None, metadata=flag(   # the CLI reads the file
        "Jinja chat template (a file, or the template text) replacing the tokenizer's own; "
        "text models only", group="limits", metavar="FILE"))
    # ("text", "audio") is vLLM-Omni's default for omni models; empty: OpenAI's (text; image
    # for an image model)
    default_modalities: tuple[str, ...] = field(default=(), metadata=flag(
        "what a chat answers with when a request names no `modalities`, e.g. text,audio as "
        "vLLM-Omni does for omni models (default: text, as OpenAI; image for an image model)",
        group="limits", value="comma", metavar="LIST"))
    # where OpenAI's answer and vLLM-Omni's differ and the request cannot tell which its client
    # reads (docs/migration-vllm-omni.md, "Dialects"); a request that tells always decides
    api_dialect: str = field(default="auto", metadata=flag(
        "answers for requests that do not say whose client sent them: openai (OpenAI's "
        "shapes), vllm-omni (vLLM-Omni's: omni chat answers text and audio as two choices, "
        "speech defaults to wav, remote media fetched), auto (default: vllm-omni when started "
        "with --omni or --stage-configs-path, else openai)", group="limits", cli_default=True,
        choices=list(API_DIALECTS)))
    # set by `serve` from --omni / --stage-configs-path: started as a vLLM-Omni user would
    vllm_omni_launch: bool = False
    # ---- stores and logs
    voices_dir: str | None = field(default=None, metadata=flag(
        "where POST /v1/audio/voices keeps uploaded voices; they survive a restart (default: "
        "~/.cache/omnistage/voices, or under $XDG_CACHE_HOME)", group="stores", metavar="DIR"))
    videos_dir: str | None = field(default=None, metadata=flag(
        "where /v1/videos keeps its jobs (SQLite) and files; they survive a restart (default: "
        "~/.cache/omnistage/videos, or under $XDG_CACHE_HOME)", group="stores", metavar="DIR"))
    videos_scope: str | None = field(default=None, metadata=flag(
        "whose jobs in the videos folder this server sees: servers with the same scope share "
        "them (replicas behind one balancer); default: one scope per served model and address "
        "(host:port; and machine, in the default folder), so a restart with the same flags "
        "keeps its jobs", group="stores", metavar="NAME"))
    max_video_jobs: int = field(default=64, metadata=flag(
        "video jobs queued or running at most (429 above; default 64)", group="stores",
        metavar="N"))
    max_video_frames: int = field(default=241, metadata=flag(
        "frames a video may have, below the model's own maximum (default 241)",
        group="stores", metavar="N"))
    max_video_size: int = field(default=1920, metadata=flag(
        "longest side of a video (default 1920)", group="stores", metavar="PIXELS"))
    max_videos_disk_bytes: int = field(default=20 << 30, metadata=flag(
        "disk the stored videos may take; beyond it new jobs get 429 until some are deleted "
        "(default 20 GiB)", group="stores", metavar="BYTES"))
    max_running_videos: int = field(default=1, metadata=flag(
        "video jobs the engine runs at once (default 1)", group="stores", metavar="N"))
    realtime_max_buffer_bytes: int = field(default=15 << 20, metadata=flag(
        "input audio a /v1/realtime session may hold uncommitted (PCM16 at 16 kHz; default "
        "15 MiB)", group="stores", metavar="BYTES"))
    realtime_max_turn_s: float = field(default=60.0, metadata=flag(
        "longest user turn of a realtime session: voice detection cuts it there, a longer "
        "commit is refused (default 60)", group="stores", name="realtime_max_turn",
        metavar="SECONDS"))
    realtime_idle_timeout_s: float = field(default=600.0, metadata=flag(
        "a realtime session with no client event this long is closed (default 600)",
        group="stores", name="realtime_idle_timeout", metavar="SECONDS"))
    realtime_resume_grace_s: float = field(default=30.0, metadata=flag(
        "a realtime session whose socket dropped waits this long for the client to resume "
        "it (session.resume), its answer running on; 0: none outlives its socket "
        "(default 30)", group="stores", name="realtime_resume_grace", metavar="SECONDS"))
    stats_log_interval_s: float = field(default=10.0, metadata=flag(
        "log each stage's stats line at most this often, when it changed (default 10; 0: "
        "never)", group="stores", name="stats_log_interval", metavar="SECONDS"))
    enable_playground: bool = field(default=True, metadata=flag(
        "serve no playground page at / (default: the page, whose tabs follow what the model "
        "can do)", group="stores", name="no_playground", value="store_false"))
    log_level: str = field(default="info", metadata=flag(
        "log level of omnistage's own lines", group="stores", cli_default=True, choices=list(LOG_LEVELS)))
    stats_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        _check(self)

    @property
    def vllm_omni_answers(self) -> bool:
        """Whether a request that does not tell gets vLLM-Omni's answer (`api_dialect`)."""
        if self.api_dialect == "auto":
            return self.vllm_omni_launch
        return self.api_dialect == "vllm-omni"

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> Any:
        """The settings the parsed flags give (an unset flag: the field's default), each
        value mapped as its field's metadata says (a comma list or repeated flag -> tuple)."""
        by_field = {f.field: f for f in server_flags()}
        kw = {}
        for f in dataclasses.fields(cls):
            value = getattr(args, f.name, None)
            if value is None:
                continue
            sf = by_field.get(f.name)
            if sf is not None and sf.value == "comma" and isinstance(value, str):
                value = [m.strip() for m in value.split(",") if m.strip()]
            if sf is not None and sf.value in ("append", "comma", "extend"):
                value = tuple(value)
            kw[f.name] = value
        return cls(**kw)


_AT_LEAST_ONE = ("max_queue", "max_body_bytes", "max_media_bytes", "max_video_jobs",
                 "max_video_frames", "max_video_size", "max_videos_disk_bytes",
                 "max_running_videos", "max_image_pixels", "max_request_pixels",
                 "max_audio_seconds", "max_input_video_frames", "max_media_parts",
                 "max_message_parts", "prep_workers")


def _check(s: ServerSettings) -> None:
    for name in _AT_LEAST_ONE:
        if getattr(s, name) < 1:
            raise ValueError(f"{name}={getattr(s, name)}: must be >= 1")
    if s.max_pending_prep < s.prep_workers:
        raise ValueError(f"max_pending_prep={s.max_pending_prep}: must be >= "
                         f"prep_workers ({s.prep_workers})")
    for d in s.allowed_media_dirs:
        if not Path(d).is_dir():
            raise ValueError(f"allowed_media_dirs: {d} is not a folder")
    if s.api_dialect not in API_DIALECTS:
        raise ValueError(f"api_dialect: {s.api_dialect!r} is not one of "
                         f"{', '.join(API_DIALECTS)}")
    parse_lora_modules(s.lora_modules)
    for m in s.default_modalities:
        if m not in ("text", "audio", "image"):
            raise ValueError(f"default_modalities: {m!r} is not one of text, audio, image")


@functools.cache
def server_flags() -> tuple[ServerFlag, ...]:
    """Every flag of the server's settings, in field order."""
    hints = get_type_hints(ServerSettings)
    out = []
    for f in dataclasses.fields(ServerSettings):
        spec = f.metadata.get("server_flag")
        if spec is None:
            continue
        name = "--" + (spec["name"] or f.name).replace("_", "-")
        default = f.default if spec["cli_default"] else None
        if spec["value"] in ("append", "extend"):
            default = []
        out.append(ServerFlag(f.name, name, spec["group"], f.metadata["help"], default,
                              spec["value"], hints[f.name], dict(spec["argparse"])))
    return tuple(out)
