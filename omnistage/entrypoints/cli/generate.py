"""`omnistage generate [MODEL] --prompt ...`: offline generation. Text is printed; images are
written as PNG files. With no MODEL, the built-in demo model draws handwritten digits."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omnistage.outputs import OmniOutput


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate for one or more prompts")
    p.add_argument("model", nargs="?", default=None,
                   help="local checkpoint folder or Hugging Face id in the local cache "
                        "(default: the built-in demo model, handwritten digits)")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stage-config", default=None,
                   help="stage-graph YAML replacing the model type's default graph")
    p.add_argument("--stage-override", action="append", default=[], metavar="STAGE.KEY=VALUE",
                   help="change one field of the graph, e.g. llm.max_num_seqs=8 (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    text = p.add_argument_group("text models")
    text.add_argument("--max-tokens", type=int, default=64)
    text.add_argument("--temperature", type=float, default=0.0)
    text.add_argument("--top-p", type=float, default=1.0)
    text.add_argument("--top-k", type=int, default=0)
    text.add_argument("--max-model-len", type=int, default=None)
    image = p.add_argument_group("image models")
    image.add_argument("--steps", type=int, default=20)
    image.add_argument("--guidance-scale", type=float, default=None,
                       help="default: the model's own")
    image.add_argument("--num-images", type=int, default=1)
    image.add_argument("--height", type=int, default=None)
    image.add_argument("--width", type=int, default=None)
    image.add_argument("--output-dir", default="omnistage-out", help="where images are written")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    from omnistage import Omni, SamplingParams
    from omnistage.diffusion.params import DiffusionParams

    with Omni(args.model, stage_config=args.stage_config, stage_overrides=args.stage_override,
              device=args.device, dtype=None if args.dtype == "auto" else args.dtype,
              max_model_len=args.max_model_len) as omni:
        if omni.engine.text_entry:
            params = DiffusionParams(height=args.height, width=args.width,
                                     num_inference_steps=args.steps,
                                     guidance_scale=args.guidance_scale, seed=args.seed,
                                     num_images=args.num_images)
        else:
            params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                    top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens)
        outs = omni.generate(args.prompt, params)
    failed = [o for o in outs if o.error]
    for out in outs:
        files = _save_images(out, Path(args.output_dir)) if not out.error else []
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": out.text, "token_ids": out.token_ids,
                              "images": files, "finish_reason": out.finish_reason,
                              "metrics": out.metrics.as_dict()}))
        elif files:
            print("\n".join(files))
        elif not out.error:
            print(out.text)
    for out in failed:
        print(f"omnistage generate: {out.prompt!r} failed: {out.error}", file=sys.stderr)
    return 1 if failed else 0


def _save_images(out: OmniOutput, folder: Path) -> list[str]:
    from omnistage.utils.images import encode_image

    pixels = out.tensors.get("images")
    if pixels is None:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, image in enumerate(pixels):
        path = folder / f"{out.request_id}-{i}.png"
        path.write_bytes(encode_image(image, "png"))
        paths.append(str(path))
    return paths
