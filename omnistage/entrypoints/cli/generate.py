"""`omnistage generate [MODEL] --prompt ...`: offline generation, answers printed to stdout."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

DEMO_DIR = Path.home() / ".cache" / "omnistage" / "tiny-qwen3"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("model", nargs="?", default=None,
                   help="local checkpoint folder or Hugging Face id in the local cache "
                        "(default: a tiny random Qwen3 built on first use)")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--stage-config", default=None,
                   help="stage-graph YAML replacing the model type's default graph")
    p.add_argument("--stage-override", action="append", default=[], metavar="STAGE.KEY=VALUE",
                   help="change one field of the graph, e.g. llm.max_num_seqs=8 (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    from omnistage import Omni, SamplingParams

    model = args.model
    if model is None and args.stage_config is None:
        from omnistage.testing.tiny_models import build_tiny_checkpoint

        if not (DEMO_DIR / "config.json").exists():
            build_tiny_checkpoint(DEMO_DIR)
        model = str(DEMO_DIR)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    with Omni(model, stage_config=args.stage_config, stage_overrides=args.stage_override,
              device=args.device, dtype=None if args.dtype == "auto" else args.dtype,
              max_model_len=args.max_model_len) as omni:
        outs = omni.generate(args.prompt, params)
    failed = [o for o in outs if o.error]
    for out in outs:
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason,
                              "metrics": out.metrics.as_dict()}))
        else:
            print(out.text)
    for out in failed:
        print(f"omnistage generate: request {out.request_id} failed: {out.error}",
              file=sys.stderr)
    return 1 if failed else 0
