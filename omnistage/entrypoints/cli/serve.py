"""`omnistage serve [MODEL]`: the OpenAI-compatible HTTP server. With no MODEL it serves the
built-in demo model (handwritten digits: POST /v1/images/generations {"prompt": "a 7"})."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", nargs="?", default=None,
                   help="local checkpoint folder or Hugging Face id in the local cache "
                        "(default: the built-in demo model, handwritten digits)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as `model` (default: MODEL as given, or "
                        "omnistage-demo)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* routes")
    p.add_argument("--stage-config", default=None,
                   help="stage-graph YAML replacing the model type's default graph")
    p.add_argument("--stage-override", action="append", default=[], metavar="STAGE.KEY=VALUE",
                   help="change one field of the graph, e.g. llm.max_num_seqs=8 (repeatable)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests in flight before new ones get 429 + Retry-After")
    p.add_argument("--allowed-media-dirs", action="append", default=[], metavar="DIR",
                   help="a folder whose files requests may name as file:// media URLs "
                        "(repeatable)")
    p.add_argument("--allow-remote-media", action="store_true",
                   help="let requests name http(s) media URLs (the server fetches them)")
    p.add_argument("--max-body-bytes", type=int, default=64 << 20,
                   help="largest request body (413 above)")
    p.add_argument("--max-media-bytes", type=int, default=20 << 20,
                   help="largest image / audio / video a request may carry or name")
    p.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGIN",
                   help="a CORS origin allowed to call the API, or * (repeatable; default: "
                        "no CORS)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template replacing the tokenizer's own")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from omnistage.entrypoints.openai.api_server import run_server

    if args.chat_template is not None:
        args.chat_template = Path(args.chat_template).read_text()
    return run_server(args)
