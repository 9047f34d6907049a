"""`omnistage bench {ar,omni,tts,diffusion,video,realtime,duplex}`: our engine and the reference
(transformers / diffusers; qwen-tts in its own interpreter) in one call, on the same
random-weight model of a real architecture built in the run; one JSON file per benchmark
(omnistage/benchmarks/ has the method of each).

    omnistage bench ar                      # Qwen3-0.6B shape, concurrency 1 / 8 / 64
    omnistage bench omni                    # Qwen3-Omni shape (scaled), concurrency 1 / 8 / 32
    omnistage bench omni --model qwen2.5-omni   # Qwen2.5-Omni-7B shape (scaled thinker)
    omnistage bench tts                     # Qwen3-TTS 1.7B CustomVoice vs qwen-tts, 1 / 8 / 32
    omnistage bench speech --family cosyvoice3  # or voxtral-tts, mimo-audio: released shape,
                                            # served graph, 1 / 8 / 32 (no reference run)
    omnistage bench diffusion               # Qwen-Image transformer, 1024x1024, 20 steps
    omnistage bench diffusion --model flux2-klein   # FLUX.2 klein 4B shape, 1024x1024, 4 steps
    omnistage bench video                   # Wan2.2-TI2V-5B and Wan2.1-14B shapes, per step
    omnistage bench realtime                # /v1/realtime on the omni model, 1 / 8 sessions
    omnistage bench duplex                  # Moshi-7B shape, full duplex, 1 .. 32 sessions
    omnistage bench agent                   # a text LLM -> Qwen3-TTS: first audio, 1 / 8
    omnistage bench regress                 # headline figures against this GPU's baseline
    omnistage bench ar --tiny --device cpu  # toy sizes: seconds on a CPU (CI), no measurement
    omnistage bench serve --base-url http://127.0.0.1:8000 --endpoint-type chat
                                            # any OpenAI-compatible server, from the client
                                            # (omnistage/benchmarks/serve.py; no model here)
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from omnistage.entrypoints.cli import bench_runs
from omnistage.entrypoints.cli.bench_args import add_kinds


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark our engines against transformers / diffusers, "
                                     "or any OpenAI-compatible server (bench serve)")
    add_kinds(p, run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    if args.benchmark == "serve":
        return bench_runs.run_serve(args)
    from omnistage.benchmarks.common import write_result

    if args.benchmark == "ar":
        result, name, headline = bench_runs.run_ar_tp(args) if args.tensor_parallel_size > 1 \
            else bench_runs.run_ar(args)
    elif args.benchmark == "omni":
        result, name, headline = bench_runs.run_omni(args)
    elif args.benchmark == "tts":
        result, name, headline = bench_runs.run_tts(args)
    elif args.benchmark == "speech":
        result, name, headline = bench_runs.run_speech(args)
    elif args.benchmark == "video":
        result, name, headline = bench_runs.run_video(args)
    elif args.benchmark == "realtime":
        result, name, headline = bench_runs.run_realtime(args)
    elif args.benchmark == "duplex":
        result, name, headline = bench_runs.run_duplex(args)
    elif args.benchmark == "agent":
        result, name, headline = bench_runs.run_agent(args)
    elif args.benchmark == "regress":
        result, name, headline = bench_runs.run_regress(args)
    elif args.model == "flux2-klein":
        result, name, headline = bench_runs.run_diffusion_flux2(args)
    elif args.model in ("flux1-dev", "z-image-turbo") or args.kernel_profile:
        result, name, headline = bench_runs.run_diffusion_variants(args)
    elif args.parallel:
        result, name, headline = bench_runs.run_diffusion_parallel(args)
    else:
        result, name, headline = bench_runs.run_diffusion(args)
    path = write_result(result, Path(args.out_dir), args.name or name)
    print(json.dumps({"benchmark": args.benchmark, "device_name": result["device_name"],
                      "ratios": headline, "result": str(path)}, indent=2))
    if args.benchmark == "regress" and headline:
        print(f"regressed: {', '.join(headline)}")
        return 1
    return 0
