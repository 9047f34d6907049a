"""`omnistage serve <folder>` for a full-duplex model (a family row with `duplex`: Moshi): no
stage graph; the duplex runtime (engine/duplex.py) ticks the model's batched session step in
the server's own process and entrypoints/openai/duplex/ serves /v1/duplex over it.

    --max-num-seqs N     the most sessions at once (default 8); one more is refused
    --dtype, --device    the model's (auto: the checkpoint's dtype, CUDA when present)
    --realtime-resume-grace     how long a dropped session waits for its resume
    --api-key, --open-metrics, --ssl-certfile / --ssl-keyfile, --no-playground
                         as on the other servers

Flags of the stage-graph servers that would change nothing here are refused, not ignored.
"""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path

from omnistage.entrypoints.cli import startup
from omnistage.entrypoints.cli.serve_args import API_KEY_ENV

logger = logging.getLogger(__name__)
DEFAULT_MAX_SESSIONS = 8
# flags a duplex server does not honour yet: refused, so no one believes them applied
UNSUPPORTED = ("stage_config", "stage_configs_path", "chat_template", "tokenizer")


def duplex_target(model: str | None) -> tuple[Path, str] | None:
    """(folder, the family's duplex target) when MODEL is a full-duplex model; else None."""
    from omnistage import registry

    if model is None:
        return None
    path = startup.resolve_model(model)
    family = registry.match_folder(path)
    if family is None or family.duplex is None:
        return None
    return path, family.duplex


def serve_duplex(args: argparse.Namespace, path: Path, target: str) -> int:
    import uvicorn

    from omnistage import registry
    from omnistage.engine.duplex import DuplexRuntime
    from omnistage.entrypoints.openai.api_server import ServerConfig
    from omnistage.entrypoints.openai.duplex.app import DuplexLimits, build_duplex_app
    from omnistage.utils.logging import configure_logging, uvicorn_log_config

    args.api_key = startup.read_api_key(args.api_key, args.api_key_file, API_KEY_ENV)
    given = [name for name in UNSUPPORTED if getattr(args, name, None)]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')} is not supported when serving a "
                         f"full-duplex model ({path.name}) yet")
    startup.check_ssl(args.ssl_certfile, args.ssl_keyfile)
    config = ServerConfig.from_namespace(args)
    configure_logging(config.log_level)
    limits = DuplexLimits(resume_grace_s=config.realtime_resume_grace_s)
    sock = startup.bind_port(args.host, args.port)
    try:
        model = registry.load(target)(path, device=_device(args.device),
                                      dtype=args.dtype or "auto",
                                      max_sessions=args.max_num_seqs or DEFAULT_MAX_SESSIONS)
        runtime = DuplexRuntime(model)
        runtime.start()
        try:
            app = build_duplex_app(runtime, config.model_name, limits, config.api_key,
                                   config.open_metrics, config.enable_playground)
            level = args.uvicorn_log_level or config.log_level
            server = uvicorn.Server(uvicorn.Config(
                app, log_level=level.lower(), log_config=uvicorn_log_config(level),
                ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                timeout_graceful_shutdown=5))
            logger.info("serving %s (full duplex, /v1/duplex) on %s://%s:%d", config.model_name,
                        "https" if args.ssl_certfile else "http", config.host, config.port)
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: None)
            server.run(sockets=[sock])
        finally:
            runtime.shutdown()
    finally:
        sock.close()
    return 0


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
