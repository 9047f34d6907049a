"""`omnistage bench {ar,omni,tts,diffusion,video,realtime}`: our engine and the reference
(transformers / diffusers; qwen-tts in its own interpreter) in one call, on the same
random-weight model of a real architecture built in the run; one JSON file per benchmark
(omnistage/benchmarks/ has the method of each).

    omnistage bench ar                      # Qwen3-0.6B shape, concurrency 1 / 8 / 64
    omnistage bench omni                    # Qwen3-Omni shape (scaled), concurrency 1 / 8 / 32
    omnistage bench omni --model qwen2.5-omni   # Qwen2.5-Omni-7B shape (scaled thinker)
    omnistage bench tts                     # Qwen3-TTS 1.7B CustomVoice vs qwen-tts, 1 / 8 / 32
    omnistage bench diffusion               # Qwen-Image transformer, 1024x1024, 20 steps
    omnistage bench diffusion --model flux2-klein   # FLUX.2 klein 4B shape, 1024x1024, 4 steps
    omnistage bench video                   # Wan2.2-TI2V-5B and Wan2.1-14B shapes, per step
    omnistage bench realtime                # /v1/realtime on the omni model, 1 / 8 sessions
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


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers")
    return values


def _replicas(text: str) -> tuple[str, ...]:
    """"talker=2,code2wav=2" -> the stage overrides talker.replicas=2, code2wav.replicas=2."""
    items = []
    for part in text.split(","):
        stage, sep, count = part.partition("=")
        if not sep or not stage or not count.isdigit():
            raise argparse.ArgumentTypeError(f"{part!r}: expected STAGE=N")
        items.append(f"{stage}.replicas={count}")
    return tuple(items)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark our engines against transformers / diffusers, "
                                     "or any OpenAI-compatible server (bench serve)")
    kinds = p.add_subparsers(dest="benchmark", required=True)
    for add in (_add_ar, _add_omni, _add_tts, _add_diffusion, _add_video, _add_realtime):
        _common(add(kinds))
    _add_serve(kinds)


def _common(q: argparse.ArgumentParser) -> None:
    """The options every benchmark takes."""
    q.add_argument("--tiny", action="store_true",
                   help="toy sizes that run in seconds on a CPU (keeps the command working; "
                        "the numbers mean nothing)")
    q.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    q.add_argument("--out-dir", default="benchmarks/results",
                   help="where the JSON result is written")
    q.add_argument("--name", default=None,
                   help="file name of the result, without .json (default: by benchmark)")
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(func=run)


def _add_ar(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    ar = kinds.add_parser("ar", help="AR engine vs transformers generate (Qwen3-0.6B shape)")
    ar.add_argument("--input-len", type=int, default=128)
    ar.add_argument("--output-len", type=int, default=128)
    ar.add_argument("--concurrency", type=_ints, default=(1, 8, 64),
                    help="comma-separated, e.g. 1,8,64")
    ar.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ar.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                    help="above 1: TP N against TP 1 through the stage runtime, on a "
                         "Qwen3-8B shape (--preset to change), concurrency 1 / 64 by default")
    ar.add_argument("--preset", default=None,
                    help="model shape: qwen3-0.6b (default), qwen3-8b (default with -tp)")
    ar.add_argument("--checkpoint-dir", default=None,
                    help="keep the random checkpoint here (default: a temporary folder)")

    return ar


def _add_omni(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    omni = kinds.add_parser("omni", help="Qwen3-Omni (or Qwen2.5-Omni) pipeline vs "
                                         "transformers generate(return_audio=True)")
    omni.add_argument("--model", choices=["qwen3-omni", "qwen2.5-omni"], default="qwen3-omni",
                      help="which omni model's shape (qwen2.5-omni: omnistage/benchmarks/"
                           "omni25.py)")
    omni.add_argument("--thinker-tokens", type=int, default=None,
                      help="text tokens per request (default 64; tiny 6)")
    omni.add_argument("--talker-tokens", type=int, default=None,
                      help="codec frames per request (default 100 = 8 s of audio; tiny 12)")
    omni.add_argument("--concurrency", type=_ints, default=(1, 8, 32))
    omni.add_argument("--reference-requests", type=int, default=3,
                      help="requests transformers runs, one by one (its latency per request "
                           "does not depend on the others); 0: ours only, no ratios")
    omni.add_argument("--stage-config", default=None,
                      help="our stage graph, e.g. qwen3_omni_2gpu (default: qwen3_omni)")
    omni.add_argument("--chunk-frames", type=int, default=None,
                      help="codec frames per code2wav chunk: the first audio waits for this "
                           "many (default: the graph's 25; tiny 8)")
    omni.add_argument("--backend", "--worker-backend", dest="backend",
                      choices=["process", "inproc", "ray"], default=None,
                      help="stage backend (default: process; inproc with --tiny)")
    omni.add_argument("--real-size", action="store_true",
                      help="Qwen3-Omni-30B-A3B's real layer and expert counts and vocabulary "
                           "(random weights, about 70 GB in bf16)")
    omni.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                      help="our thinker over N GPUs (the default graph's -tp); transformers "
                           "then spreads the model over the same GPUs (device_map='auto')")
    omni.add_argument("--ray-address", default=None, metavar="ADDRESS",
                      help="--backend ray: the cluster to join (default: start or join a "
                           "local one)")
    omni.add_argument("--replicas", type=_replicas, default=(), metavar="STAGE=N,...",
                      help="replicas of stages, e.g. talker=2,code2wav=2")
    omni.add_argument("--layouts", default=None, metavar="NAMES",
                      help="comma-separated GPU layouts, each its own engine on one "
                           "checkpoint, ours only: tp2, tp4, tp2-split, ray-tp4, ray-2xtp2 "
                           "(omnistage/benchmarks/omni_layouts.py)")
    omni.add_argument("--stage-override", action="append", default=[],
                      metavar="STAGE.KEY=VALUE", help="change one field of our graph "
                                                      "(repeatable)")

    return omni


def _add_tts(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    tts = kinds.add_parser("tts", help="Qwen3-TTS (1.7B CustomVoice shape) vs qwen-tts's "
                                       "generate_custom_voice")
    tts.add_argument("--frames", type=int, default=None,
                     help="codec frames (talker steps) per request (default 100 = 8 s of "
                          "audio; tiny 8)")
    tts.add_argument("--concurrency", type=_ints, default=(1, 8, 32))
    tts.add_argument("--reference-requests", type=int, default=3,
                     help="requests qwen-tts runs, one by one; 0: ours only, no ratios (the "
                          "checkpoint is still built by qwen-tts's classes)")
    tts.add_argument("--first-chunk-frames", type=int, default=None,
                     help="codec frames of code2wav's first chunk (default: the graph's 6)")
    tts.add_argument("--backend", choices=["process", "inproc"], default=None,
                     help="stage backend (default: process; inproc with --tiny)")
    return tts


def _add_diffusion(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    diff = kinds.add_parser("diffusion", help="Qwen-Image (or FLUX.2 klein) transformer vs "
                                              "diffusers")
    diff.add_argument("--model", default="qwen-image",
                      choices=["qwen-image", "flux2-klein", "flux1-dev", "z-image-turbo"],
                      help="the transformer's shape (flux2-klein: the 4B; without --parallel, "
                           "--compile, --quantization, --num-layers; flux1-dev, "
                           "z-image-turbo: every variant of ours and diffusers' in one loop, "
                           "with a kernel profile, benchmarks/diffusion_variants.py)")
    diff.add_argument("--kernel-profile", action="store_true",
                      help="qwen-image: the variants run of flux1-dev / z-image-turbo (diffusers "
                           "eager and compiled, ours unfused / fused / compiled / FP8) with each "
                           "one's device time by kernel kind")
    diff.add_argument("--start-times", action="store_true",
                      help="with the variants run: the compile's cold and warm start in fresh "
                           "processes over one empty inductor cache")
    diff.add_argument("--size", type=int, default=None, help="pixels (default 1024; tiny 64)")
    diff.add_argument("--steps", type=int, default=None,
                      help="default 20 (flux2-klein: 4); tiny 4")
    diff.add_argument("--num-layers", type=int, default=None,
                      help="transformer blocks (default: the real 60; tiny 2)")
    diff.add_argument("--text-len", type=int, default=None,
                      help="caption tokens (default 64; flux1-dev 512, z-image-turbo 128)")
    diff.add_argument("--cache-thresholds", type=_floats, default=None,
                      help="step-cache thresholds to try, comma-separated")
    diff.add_argument("--concurrency", type=int, default=4)
    diff.add_argument("--parallel", default=None, metavar="LAYOUTS",
                      help="comma-separated layouts against 1 GPU, true CFG: cfg, ulysses, "
                           "tp, ring (2 GPUs each), or axes with degrees joined by x "
                           "(tp4, ulysses4, cfg2xulysses2)")
    diff.add_argument("--no-reference", action="store_true",
                      help="with --parallel: skip diffusers' transformer")
    diff.add_argument("--compile", action="store_true",
                      help="also time our transformer with its blocks torch.compile'd (with "
                           "--parallel: every layout's)")
    diff.add_argument("--quantization", default=None, choices=["fp8"],
                      help="also our transformer with FP8 linears (a GPU of compute capability "
                           "8.9+; --tiny: on the CPU): speed against diffusers eager and "
                           "compiled, image PSNR against our bf16, with and without step caching")
    diff.add_argument("--no-cuda-graphs", action="store_true",
                      help="with --parallel: every layout's transformer eager (by default "
                           "its forwards replay from CUDA graphs on a GPU, as a stage's)")
    return diff


def _add_video(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    video = kinds.add_parser("video", help="Wan transformers (TI2V-5B, 14B shapes) vs "
                                           "diffusers, per denoising step with CFG")
    video.add_argument("--models", default="5b,14b",
                       help="comma-separated: 5b (Wan2.2-TI2V-5B, 704x1280, 121 frames), "
                            "14b (Wan2.1-14B, 832x480, 81 frames)")
    video.add_argument("--steps", type=int, default=None,
                       help="our schedule, plain and step-cached (default 10; tiny 3)")
    video.add_argument("--timed-steps", type=int, default=None,
                       help="diffusers' timed steps after one warm-up (default 3; tiny 1)")
    video.add_argument("--cache-thresholds", type=_floats, default=None,
                       help="step-cache thresholds to try, comma-separated (default: one "
                            "per model)")
    video.add_argument("--no-compile", action="store_true",
                       help="skip diffusers with compile_repeated_blocks")
    video.add_argument("--no-cuda-graphs", action="store_true",
                       help="our transformer eager (by default replayed from CUDA graphs "
                            "on a GPU, as a stage's)")
    video.add_argument("--compile-ours", action="store_true",
                       help="also time our transformer with its blocks compiled (a stage's "
                            "compile: true; its compile adds a minute or two a model)")
    video.add_argument("--parallel", default=None, metavar="LAYOUTS",
                       help="Wan2.2-T2V-A14B at 720p, 81 frames, through the engine on 1 GPU "
                            "and on each comma-separated layout (ulysses, cfg, tp: 2 GPUs; "
                            "ulysses4, cfg2xulysses2, tp4: 4), against diffusers on 1 GPU")
    video.add_argument("--no-reference", action="store_true",
                       help="with --parallel: skip diffusers")
    return video


def _add_realtime(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    rt = kinds.add_parser("realtime", help="spoken turns over /v1/realtime on the Qwen3-Omni "
                                           "benchmark model: first audio, barge-in")
    rt.add_argument("--concurrency", type=_ints, default=(1, 8),
                    help="sessions speaking at once, comma-separated")
    rt.add_argument("--turns", type=int, default=3, help="spoken turns per session")
    rt.add_argument("--utterance-s", type=float, default=2.0, help="seconds of each turn")
    rt.add_argument("--thinker-tokens", type=int, default=None,
                    help="text tokens of each answer (default 32; tiny 4)")
    rt.add_argument("--talker-tokens", type=int, default=200,
                    help="codec frames of an answer at most (12.5 a second of speech)")
    return rt


def _add_serve(kinds: argparse._SubParsersAction) -> None:
    """Flags named as `vllm bench serve`'s; none of the common ones (no model runs here)."""
    from omnistage.benchmarks.serve import ALIASES, METRICS, ROUTES

    sv = kinds.add_parser("serve", help="load a running OpenAI-compatible server (ours or any): "
                                        "TTFT, TPOT, ITL, throughput, first audio, RTF, images/s")
    sv.add_argument("--base-url", default="http://127.0.0.1:8000",
                    help="the server's root (a trailing /v1 is dropped)")
    sv.add_argument("--endpoint-type", "--backend", dest="endpoint_type", default="chat",
                    choices=[*ROUTES, *ALIASES],
                    help="chat (streamed), completions (streamed), chat-audio (chat with "
                         "modalities text+audio, streamed pcm16), speech (/v1/audio/speech), "
                         "images (/v1/images/generations); vLLM's openai-chat / openai too")
    sv.add_argument("--endpoint", default=None,
                    help="the route's path, if not the type's (e.g. /v1/chat/completions)")
    sv.add_argument("--model", default=None, help="default: the first of /v1/models")
    sv.add_argument("--num-prompts", type=int, default=100)
    sv.add_argument("--max-concurrency", type=int, default=None,
                    help="requests in flight at most (default: no bound)")
    sv.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests per second, Poisson arrivals (seeded); inf: all at once")
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--random-input-len", type=int, default=None,
                    help="words in each synthetic prompt (default: 1024 for chat and "
                         "completions, 64 chat-audio, 32 speech, 16 images)")
    sv.add_argument("--random-output-len", type=int, default=128,
                    help="max_tokens of each text request")
    sv.add_argument("--prompt", default=None, help="this prompt for every request instead")
    sv.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="send vLLM's ignore_eos so that answers last max_tokens (--no-ignore-eos "
                         "for a server that refuses the field)")
    sv.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    sv.add_argument("--timeout", type=float, default=600.0,
                    help="seconds a request may take in all; a late one counts as failed")
    sv.add_argument("--voice", default=None, help="speech and chat-audio (default: the model's)")
    sv.add_argument("--audio-format", choices=["wav", "pcm"], default="wav",
                    help="speech's response_format")
    sv.add_argument("--audio-sample-rate", type=int, default=24000,
                    help="the rate of pcm (speech --audio-format pcm, chat-audio's pcm16)")
    sv.add_argument("--image-size", default=None, help="images: size, e.g. 512x512")
    sv.add_argument("--percentile-metrics", default=None,
                    help=f"comma-separated, of {','.join(METRICS)} (default: ttft,tpot,itl,"
                         "e2el for text; ttfa,rtf,e2el speech; ttft,ttfa,rtf,e2el chat-audio; "
                         "e2el images)")
    sv.add_argument("--metric-percentiles", type=_floats, default=(50.0, 90.0, 99.0),
                    help="comma-separated, e.g. 50,90,99")
    sv.add_argument("--result-dir", default="benchmarks/results")
    sv.add_argument("--result-filename", default=None,
                    help="default: serve_TYPE_MODEL_cC_rR_TIME.json")
    sv.add_argument("--save-result", action="store_true",
                    help="accepted as vLLM's; the JSON is always written")
    sv.set_defaults(func=run)


def _run_serve(args: argparse.Namespace) -> int:
    import os
    import re
    import time

    from omnistage.benchmarks import serve

    metrics = tuple(m for m in (args.percentile_metrics or "").split(",") if m) or None
    cfg = serve.ServeBenchConfig(
        base_url=args.base_url, endpoint_type=args.endpoint_type, endpoint=args.endpoint,
        model=args.model, num_prompts=args.num_prompts, max_concurrency=args.max_concurrency,
        request_rate=args.request_rate, seed=args.seed, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, prompt=args.prompt, ignore_eos=args.ignore_eos,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"), timeout_s=args.timeout,
        voice=args.voice, audio_format=args.audio_format,
        audio_sample_rate=args.audio_sample_rate, image_size=args.image_size,
        percentile_metrics=metrics, metric_percentiles=args.metric_percentiles)
    result = serve.run(cfg)
    summary = result["summary"]
    if summary["first_error"]:
        print(f"{summary['failed']} of {cfg.num_prompts} requests failed; the first, "
              f"{summary['first_error']}")
    print(serve.table(cfg, summary))
    name = args.result_filename or "serve_{}_{}_c{}_r{}_{}.json".format(
        cfg.endpoint_type, re.sub(r"[^A-Za-z0-9._-]+", "-", result["model"]).strip("-"),
        cfg.max_concurrency or "inf", summary["request_rate"], time.strftime("%Y%m%d-%H%M%S"))
    path = Path(args.result_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    print(f"result: {path}")
    return 0 if summary["completed"] else 1


Outcome = tuple[dict, str, object]     # (the result, its file name, the headline to print)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    if args.benchmark == "serve":
        return _run_serve(args)
    from omnistage.benchmarks.common import write_result

    if args.benchmark == "ar":
        result, name, headline = _run_ar_tp(args) if args.tensor_parallel_size > 1 \
            else _run_ar(args)
    elif args.benchmark == "omni":
        result, name, headline = _run_omni(args)
    elif args.benchmark == "tts":
        result, name, headline = _run_tts(args)
    elif args.benchmark == "video":
        result, name, headline = _run_video(args)
    elif args.benchmark == "realtime":
        result, name, headline = _run_realtime(args)
    elif args.model == "flux2-klein":
        result, name, headline = _run_diffusion_flux2(args)
    elif args.model in ("flux1-dev", "z-image-turbo") or args.kernel_profile:
        result, name, headline = _run_diffusion_variants(args)
    elif args.parallel:
        result, name, headline = _run_diffusion_parallel(args)
    else:
        result, name, headline = _run_diffusion(args)
    path = write_result(result, Path(args.out_dir), args.name or name)
    print(json.dumps({"benchmark": args.benchmark, "device_name": result["device_name"],
                      "ratios": headline, "result": str(path)}, indent=2))
    return 0


def _lengths(args: argparse.Namespace) -> dict[str, int]:
    return {"input_len": min(args.input_len, 16) if args.tiny else args.input_len,
            "output_len": min(args.output_len, 8) if args.tiny else args.output_len}


def _run_ar(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import ar

    cfg = ar.ARBenchConfig(
        preset="tiny" if args.tiny else (args.preset or "qwen3-0.6b"), **_lengths(args),
        concurrency=args.concurrency, device=args.device,
        max_num_batched_tokens=args.max_num_batched_tokens,
        checkpoint_dir=args.checkpoint_dir, seed=args.seed)
    result = ar.run(cfg)
    return (result, f"ar_{cfg.preset}_c{'-'.join(map(str, cfg.concurrency))}",
            {c: r["throughput_ratio"] for c, r in result["by_concurrency"].items()})


def _run_ar_tp(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import ar_tp

    cfg = ar_tp.ARTPBenchConfig(
        preset="tiny" if args.tiny else (args.preset or "qwen3-8b"),
        tensor_parallel_size=args.tensor_parallel_size, **_lengths(args),
        concurrency=args.concurrency if args.concurrency != (1, 8, 64) else (1, 64),
        device=args.device, checkpoint_dir=args.checkpoint_dir, seed=args.seed)
    result = ar_tp.run(cfg)
    return result, f"ar_tp{cfg.tensor_parallel_size}_{cfg.preset}", result["ratios"]


def _run_omni(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import omni

    if args.layouts:
        return _run_omni_layouts(args)

    cfg = omni.OmniBenchConfig.preset(
        "tiny" if args.tiny else "real" if args.real_size else "bench", model=args.model,
        device=args.device,
        seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
        concurrency=args.concurrency, reference_requests=args.reference_requests,
        thinker_tokens=args.thinker_tokens, talker_tokens=args.talker_tokens,
        backend=args.backend, chunk_frames=args.chunk_frames, stage_config=args.stage_config,
        ray_address=args.ray_address,
        stage_overrides=(*args.replicas, *args.stage_override))
    if cfg.model == "qwen2.5-omni":   # its own bench, on omni.py's config and helpers
        from omnistage.benchmarks import omni25

        result = omni25.run(cfg)
    else:
        result = omni.run(cfg)
    tp = f"_tp{cfg.tensor_parallel_size}" if cfg.tensor_parallel_size > 1 else ""
    return result, f"omni_{cfg.model}-{cfg.sizes}{tp}", result["ratios"]


def _run_omni_layouts(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import omni, omni_layouts

    names = tuple(args.layouts.split(","))
    omni_layouts.check_layouts(names)
    cfg = omni.OmniBenchConfig.preset(
        "tiny" if args.tiny else "real" if args.real_size else "bench", device=args.device,
        seed=args.seed, concurrency=args.concurrency, reference_requests=0,
        thinker_tokens=args.thinker_tokens, talker_tokens=args.talker_tokens,
        chunk_frames=args.chunk_frames, ray_address=args.ray_address,
        stage_overrides=tuple(args.stage_override))
    name = args.name or f"omni_layouts_qwen3-omni-{cfg.sizes}"
    result = omni_layouts.run(cfg, names, Path(args.out_dir), name)
    return result, name, result["ratios"]


def _run_tts(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import tts

    cfg = tts.TTSBenchConfig.preset(
        "tiny" if args.tiny else "1.7b", frames=args.frames, backend=args.backend,
        concurrency=args.concurrency, reference_requests=args.reference_requests,
        first_chunk_frames=args.first_chunk_frames, device=args.device, seed=args.seed)
    result = tts.run(cfg)
    return result, f"tts_qwen3-tts-{cfg.sizes}", result["ratios"]


def _run_realtime(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import realtime

    cfg = realtime.RealtimeBenchConfig(
        sizes="tiny" if args.tiny else "bench", concurrency=args.concurrency, turns=args.turns,
        utterance_s=args.utterance_s, device=args.device, seed=args.seed,
        thinker_tokens=args.thinker_tokens or (4 if args.tiny else 32),
        talker_tokens=args.talker_tokens)
    result = realtime.run(cfg)
    return result, f"realtime_qwen3-omni-{cfg.sizes}", result["ratios"]


def _run_diffusion_parallel(args: argparse.Namespace) -> Outcome:
    import tempfile

    from omnistage.benchmarks import diffusion_parallel as dp

    tiny = args.tiny
    cfg = dp.ParallelBenchConfig(
        sizes="tiny" if tiny else "qwen-image", size=args.size or (64 if tiny else 1024),
        steps=args.steps or (4 if tiny else 20),
        num_layers=args.num_layers or (2 if tiny else 60), text_len=args.text_len or 64,
        layouts=tuple(args.parallel.split(",")), reference=not args.no_reference,
        compile=args.compile, cuda_graphs=not args.no_cuda_graphs, device=args.device,
        seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-parallel-") as tmp:
        result = dp.run(cfg, Path(tmp))
    return result, f"diffusion_parallel_{cfg.sizes}_{cfg.size}px", result["ratios"]


def _run_diffusion(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import diffusion

    cfg = diffusion.DiffusionBenchConfig.preset(
        "tiny" if args.tiny else "qwen-image", device=args.device, seed=args.seed,
        size=args.size, steps=args.steps, num_layers=args.num_layers,
        text_len=args.text_len or 64, cache_thresholds=args.cache_thresholds,
        concurrency=args.concurrency, compile=args.compile, quantization=args.quantization)
    from omnistage.benchmarks.diffusion_fp8 import bench_fp8

    result = diffusion.run(cfg, fp8=bench_fp8)
    suffix = f"_{cfg.quantization}" if cfg.quantization else ""
    return result, f"diffusion_{cfg.sizes}_{cfg.size}px{suffix}", result["ratios"]


def _run_diffusion_variants(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import diffusion_variants as dv

    cfg = dv.VariantsConfig(model=args.model, tiny=args.tiny, size=args.size, steps=args.steps,
                            text_len=args.text_len, start_times=args.start_times,
                            device=args.device, seed=args.seed)
    result = dv.run(cfg)
    tiny = "_tiny" if cfg.tiny else ""
    return result, f"diffusion_variants_{cfg.model}{tiny}_{cfg.pixels}px", result["ratios"]


def _run_diffusion_flux2(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import diffusion_flux2

    unsupported = [flag for flag, value in (("--parallel", args.parallel),
                                            ("--compile", args.compile),
                                            ("--quantization", args.quantization),
                                            ("--num-layers", args.num_layers)) if value]
    if unsupported:
        raise ValueError(f"{unsupported[0]}: not measured for --model flux2-klein")
    tiny = args.tiny
    cfg = diffusion_flux2.Flux2BenchConfig(
        sizes="tiny" if tiny else "klein-4b", size=args.size or (64 if tiny else 1024),
        steps=args.steps or 4, text_len=args.text_len or 64,
        cache_thresholds=args.cache_thresholds or ((0.2, 0.5) if tiny else (0.1, 0.2, 0.4, 0.8)),
        concurrency=args.concurrency, device=args.device, seed=args.seed)
    result = diffusion_flux2.run(cfg)
    return result, f"diffusion_flux2-klein_{cfg.sizes}_{cfg.size}px", result["ratios"]


def _run_video(args: argparse.Namespace) -> Outcome:
    if args.parallel:
        return _run_video_parallel(args)
    from omnistage.benchmarks import video

    sizes = "tiny" if args.tiny else "real"
    cfg = video.VideoBenchConfig.preset(
        sizes, steps=args.steps, timed_steps=args.timed_steps,
        models=tuple(args.models.split(",")), cache_thresholds=args.cache_thresholds,
        cuda_graphs=not args.no_cuda_graphs, compile_ours=args.compile_ours,
        device=args.device, seed=args.seed,
        **({"compile_backend": ""} if args.no_compile else {}))
    result = video.run(cfg)
    return result, f"video_wan_{sizes}", result["ratios"]


def _run_video_parallel(args: argparse.Namespace) -> Outcome:
    import tempfile

    from omnistage.benchmarks import video_parallel as vp
    from omnistage.benchmarks.common import write_result

    cfg = vp.VideoParallelConfig(
        sizes="tiny" if args.tiny else "a14b", steps=args.steps or 2,
        layouts=tuple(args.parallel.split(",")), reference=not args.no_reference,
        device=args.device, seed=args.seed)
    name = args.name or f"video_parallel_wan-{cfg.sizes}"
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-video-parallel-") as tmp:
        result = vp.run(cfg, Path(tmp), lambda r: write_result(r, Path(args.out_dir), name))
    return result, name, result["ratios"]
