"""`omnistage serve [MODEL]`: the OpenAI-compatible HTTP server. With no MODEL it serves the
built-in demo model (handwritten digits: POST /v1/images/generations {"prompt": "a 7"}).

Start-up, in the order that makes a mistake cheap:

    flags (-tp) -> model folder and weights -> tokenizer, chat template, API key, TLS files -> stage
    graph (engine flags as overrides of the main stage, checked against the model) -> port
    bound -> engine loads -> uvicorn on the bound socket
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from omnistage.entrypoints.cli import startup
from omnistage.entrypoints.cli.flags import FILE_MODEL_FLAG
from omnistage.entrypoints.cli.serve_args import API_KEY_ENV, add_engine_args, add_server_args

if TYPE_CHECKING:
    from omnistage.configs.schema import GraphConfig

logger = logging.getLogger(__name__)

DESCRIPTION = """\
Serve a model over an OpenAI-compatible HTTP API.

Engine flags (vLLM's names) set a key of the model's main stage: its first ar stage (an LLM,
Qwen3-Omni's thinker), else its image-producing diffusion stage. `--stage-override
STAGE.KEY=VALUE` sets any key of any stage and wins over them. A flag the model's main stage
does not read is refused."""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description=DESCRIPTION, allow_abbrev=False,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="local checkpoint folder or Hugging Face id in the local cache "
                        "(default: the built-in demo model, handwritten digits)")
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                   help="MODEL as a flag, as vLLM takes it")
    p.add_argument(FILE_MODEL_FLAG, dest="model_from_config", default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="YAML file of flags: keys are flag names (dashes or underscores), e.g. "
                        "`max-num-seqs: 8`; a flag on the command line wins over the file")
    add_server_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)
    return p


def model_name(args: argparse.Namespace) -> str | None:
    """MODEL from the positional, --model or the --config file (in that order of precedence)."""
    if args.model and args.model_flag and args.model != args.model_flag:
        raise ValueError(f"two models given: {args.model!r} and --model {args.model_flag!r}")
    return args.model or args.model_flag or args.model_from_config


def build_graph(args: argparse.Namespace, model_path: Path | None) -> GraphConfig:
    """The stage graph with the engine flags applied to its main stage, checked against the
    model (flags that do not apply, --max-model-len over the limit) before anything loads."""
    from omnistage.configs.defaults import resolve_graph
    from omnistage.configs.parse import load_yaml
    from omnistage.entrypoints.cli import stage_flags

    if args.stage_configs_path is not None:   # vLLM-Omni's stage_args file, translated
        from omnistage.configs.vllm_stage_config import stage_configs_yaml

        if args.stage_config is not None:
            raise ValueError("--stage-config and --stage-configs-path both given: pass one")
        args.stage_config = stage_configs_yaml(args.stage_configs_path)
    elif args.stage_config is not None and Path(args.stage_config).is_file():
        load_yaml(Path(args.stage_config).read_text(), args.stage_config)  # names file + line
    model = str(model_path) if model_path else None
    base = resolve_graph(model, model_path, args.stage_config, args.stage_override)
    items = stage_flags.flag_overrides(base, args)
    if args.tokenizer is not None:
        from omnistage import registry

        family = registry.match_folder(model_path) if model_path is not None else None
        if family is not None and family.processor is not None:
            raise ValueError("--tokenizer does not apply to this model: its input processor "
                             "brings its own tokenizer")
    graph = resolve_graph(model, model_path, args.stage_config, [*items, *args.stage_override])
    stage_flags.check_max_model_len(graph)
    return graph


def prepare(args: argparse.Namespace) -> tuple[GraphConfig, socket.socket]:
    """Every check that needs no model loaded; the graph to run and the bound socket."""
    args.model = model_name(args)
    model_path = startup.resolve_model(args.model) if args.model is not None else None
    if args.tokenizer is not None:
        args.tokenizer = startup.resolve_tokenizer(args.tokenizer)
    if args.chat_template is not None:
        args.chat_template = startup.read_chat_template(args.chat_template)
    args.api_key = startup.read_api_key(args.api_key, args.api_key_file, API_KEY_ENV)
    startup.check_ssl(args.ssl_certfile, args.ssl_keyfile)
    graph = build_graph(args, model_path)
    return graph, startup.bind_port(args.host, args.port)


def run(args: argparse.Namespace) -> int:
    """Check, load the engine, serve until SIGINT/SIGTERM, shut the engine down."""
    from omnistage.entrypoints.cli.serve_duplex import duplex_target, serve_duplex

    duplex = duplex_target(model_name(args))   # a full-duplex model: no stage graph
    if duplex is not None:
        return serve_duplex(args, *duplex)
    graph, sock = prepare(args)
    try:
        return _serve(args, graph, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, graph: GraphConfig, sock: socket.socket) -> int:
    import uvicorn

    from omnistage.engine.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import ServerConfig, build_app
    from omnistage.entrypoints.openai.slow_clients import guarded_protocol
    from omnistage.utils.logging import configure_logging, uvicorn_log_config

    config = dataclasses.replace(ServerConfig.from_namespace(args), vllm_omni_launch=bool(
        args.omni or args.stage_configs_path))
    configure_logging(config.log_level)
    engine = AsyncOmni(args.model, graph=graph, device=args.device)
    try:
        app = build_app(engine, config)
        server = uvicorn.Server(uvicorn.Config(
            app, http=guarded_protocol(config.connection_limits),
            log_level=(args.uvicorn_log_level or config.log_level).lower(),
            log_config=uvicorn_log_config(args.uvicorn_log_level or config.log_level),
            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
            timeout_graceful_shutdown=5))
        scheme = "https" if args.ssl_certfile else "http"
        logger.info("serving %s on %s://%s:%d", config.model_name, scheme, config.host,
                    config.port)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again under
        # the handlers it found; these let that pass so that the engine is shut down below
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    return 0
