"""`omnistage generate [MODEL] --prompt ...`: offline generation, answers printed to stdout."""

from __future__ import annotations

import argparse
import json
import logging
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
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    from omnistage import Omni, SamplingParams

    model = args.model
    if model is None:
        from omnistage.testing.tiny_models import build_tiny_checkpoint

        if not (DEMO_DIR / "config.json").exists():
            build_tiny_checkpoint(DEMO_DIR)
        model = str(DEMO_DIR)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    omni = Omni(model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len)
    for out in omni.generate(args.prompt, params):
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason,
                              "metrics": out.metrics.as_dict()}))
        else:
            print(out.text)
    return 0
