"""`omnistage generate [MODEL] --prompt ...`: offline generation. Text is printed; images are
written as PNG files and speech as WAV files. With no MODEL, the built-in demo model draws
handwritten digits."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from omnistage.entrypoints.cli.serve_args import add_engine_args

if TYPE_CHECKING:
    from omnistage.configs.schema import GraphConfig
    from omnistage.outputs import OmniOutput

T = TypeVar("T")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate for one or more prompts")
    p.add_argument("model", nargs="?", default=None,
                   help="local checkpoint folder or Hugging Face id in the local cache "
                        "(default: the built-in demo model, handwritten digits)")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap each prompt as a user chat message (chat template); default: on "
                        "for multimodal chat models (Qwen3-Omni), off otherwise")
    p.add_argument("--modalities", default=None,
                   help="comma-separated outputs to produce, e.g. text or text,audio "
                        "(default: all the model has)")
    p.add_argument("--speaker", default=None, help="voice of speech output (Qwen3-Omni: "
                                                   "ethan, chelsie, ...)")
    p.add_argument("--voice", default=None,
                   help="a text-to-speech model's voice (Qwen3-TTS CustomVoice: a preset)")
    p.add_argument("--instructions", default=None,
                   help="a text-to-speech model's style or described voice (Qwen3-TTS)")
    p.add_argument("--language", default=None, help="a text-to-speech model's language "
                                                    "(Qwen3-TTS; default: auto)")
    p.add_argument("--out", default=None,
                   help="the audio file of the one prompt (format by extension: .wav, .flac, "
                        "...), instead of --output-dir/<request>.wav")
    text = p.add_argument_group("text models (refused for an image model)")
    text.add_argument("--max-tokens", type=int, default=None, help="default: 64")
    text.add_argument("--temperature", type=float, default=None, help="default: 0 (greedy)")
    text.add_argument("--top-p", type=float, default=None, help="default: 1")
    text.add_argument("--top-k", type=int, default=None, help="default: 0 (off)")
    image = p.add_argument_group("image models (refused for a text model)")
    image.add_argument("--steps", type=int, default=None, help="default: 20")
    image.add_argument("--guidance-scale", type=float, default=None,
                       help="default: the model's own")
    image.add_argument("--guidance-scale-2", type=float, default=None,
                       help="Wan2.2 A14B's low-noise expert (default: --guidance-scale)")
    image.add_argument("--num-images", type=int, default=None, help="default: 1")
    image.add_argument("--height", type=int, default=None)
    image.add_argument("--width", type=int, default=None)
    image.add_argument("--image", default=None, metavar="PATH", action="append",
                       help="an image file to start from: image-to-image, or the first frame "
                            "of image-to-video; repeated: a multi-image edit's images, in "
                            "order (Qwen-Image-Edit-Plus, FLUX.2's reference images)")
    image.add_argument("--num-frames", type=int, default=None,
                       help="video models: frames (default: the model's)")
    image.add_argument("--fps", type=float, default=None,
                       help="video models: the file's frame rate (default: the model's)")
    image.add_argument("--output-dir", default="omnistage-out",
                       help="where images, videos (MP4) and audio are written")
    add_engine_args(p)   # the same engine flags as `serve` (--seed: also an image's seed)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    from omnistage import Omni, SamplingParams
    from omnistage.diffusion.params import DiffusionParams

    with Omni(args.model, graph=_graph(args), device=args.device) as omni:
        video = omni.engine.video
        fps = args.fps or (video.fps if video else None)
        if omni.engine.text_entry:
            params = DiffusionParams(height=args.height, width=args.width,
                                     num_inference_steps=_or(args.steps, 20),
                                     guidance_scale=args.guidance_scale,
                                     guidance_scale_2=args.guidance_scale_2, seed=args.seed,
                                     num_images=_or(args.num_images, 1),
                                     num_frames=args.num_frames or (
                                         video.default_num_frames if video else None),
                                     fps=fps,
                                     image=_file(args.image, 0),
                                     extra_images=tuple(_file(args.image, i) for i in
                                                        range(1, len(args.image or ()))))
        else:
            params = SamplingParams(temperature=_or(args.temperature, 0.0),
                                    top_p=_or(args.top_p, 1.0), top_k=_or(args.top_k, 0),
                                    seed=args.seed, max_tokens=_or(args.max_tokens, 64))
            voice = {k: v for k in ("voice", "instructions", "language")
                     if (v := getattr(args, k)) is not None}
            params = replace(params, extra=voice)    # a TTS talker, the entry stage, reads it
            if args.speaker is not None:   # entry stage as asked, the others: their defaults
                params = [params if not s.inputs else replace(
                    s.default_sampling(), extra={"speaker": args.speaker})
                    if s.kind == "ar" else None for s in omni.engine.graph.stages]
        chat = args.chat if args.chat is not None else omni.engine.processor is not None
        prompts = [{"messages": [{"role": "user", "content": p}]} if chat else p
                   for p in args.prompt]
        modalities = set(args.modalities.split(",")) if args.modalities else None
        outs = omni.generate(prompts, params, output_modalities=modalities)
    failed = [o for o in outs if o.error]
    for prompt, out in zip(args.prompt, outs):
        out.prompt = prompt
        files = [] if out.error else (_save_images(out, Path(args.output_dir))
                                      + _save_video(out, Path(args.output_dir), fps)
                                      + _save_audio(out, Path(args.output_dir), args.out))
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": out.text, "token_ids": out.token_ids,
                              "files": files, "finish_reason": out.finish_reason,
                              "metrics": out.metrics.as_dict()}))
        elif not out.error:
            print("\n".join(([out.text] if out.text else []) + files))
    for out in failed:
        print(f"omnistage generate: {out.prompt!r} failed: {out.error}", file=sys.stderr)
    return 1 if failed else 0


TEXT_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "max_model_len", "speaker", "chat",
              "voice", "instructions", "language")
IMAGE_FLAGS = ("steps", "guidance_scale", "guidance_scale_2", "num_images", "height", "width",
               "image", "num_frames", "fps")


def _file(paths: list[str] | None, idx: int) -> bytes | None:
    """The `idx`-th --image file's bytes (None: fewer given)."""
    return Path(paths[idx]).read_bytes() if paths and idx < len(paths) else None


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _graph(args: argparse.Namespace) -> GraphConfig:
    """The graph to run, checked before anything loads: the flags of the other kind of model
    (--steps for a text model, --max-tokens for an image model) and a --max-model-len above
    the model's limit are refused."""
    from omnistage.configs.defaults import resolve_graph
    from omnistage.entrypoints.cli import stage_flags
    from omnistage.entrypoints.cli.serve import build_graph
    from omnistage.entrypoints.cli.startup import resolve_model, resolve_tokenizer

    if args.out is not None and len(args.prompt) > 1:
        raise ValueError(f"--out: one audio file for one prompt, got {len(args.prompt)} "
                         "prompts (use --output-dir)")
    path = resolve_model(args.model) if args.model is not None else None
    model = str(path) if path else None
    graph = resolve_graph(model, path, args.stage_config, args.stage_override)
    main = stage_flags.main_stage(graph)
    wrong = IMAGE_FLAGS if main.kind == "ar" else TEXT_FLAGS
    given = [f"--{f.replace('_', '-')}" for f in wrong if getattr(args, f) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: {'image' if main.kind == 'ar' else 'text'}-model "
                         f"flag{'s' if len(given) > 1 else ''}, and this model's main stage "
                         f"{main.name!r} is a{'n' if main.kind == 'ar' else ''} {main.kind} stage")
    if args.tokenizer is not None:
        args.tokenizer = resolve_tokenizer(args.tokenizer)
    # the engine flags as `serve` applies them; --seed on an image model is the images' seed
    seed = args.seed if main.kind == "ar" else None
    engine = argparse.Namespace(**{**vars(args), "seed": seed})
    return build_graph(engine, path)


def _save_images(out: OmniOutput, folder: Path) -> list[str]:
    from omnistage.utils.images import encode_image

    pixels = out.pixels
    if pixels is None:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, image in enumerate(pixels):
        path = folder / f"{out.request_id}-{i}.png"
        path.write_bytes(encode_image(image, "png"))
        paths.append(str(path))
    return paths


def _save_video(out: OmniOutput, folder: Path, fps: float | None) -> list[str]:
    if out.video is None:
        return []
    assert fps is not None, "a video from a model that declares no VideoSpec"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{out.request_id}.mp4"
    out.save_video(path, fps)
    return [str(path)]


def _save_audio(out: OmniOutput, folder: Path, file: str | None) -> list[str]:
    if out.audio is None or out.sample_rate is None:
        return []
    path = Path(file) if file else folder / f"{out.request_id}.wav"
    path.parent.mkdir(parents=True, exist_ok=True)
    out.save_audio(path)
    return [str(path)]
