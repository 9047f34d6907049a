"""`omnistage bench KIND`'s flags turned into each benchmark's config, the benchmark run, and
(result, file name, headline) returned to bench.py, which writes the result; `bench serve`
writes its own (vLLM's file name). The benchmarks import lazily: `omnistage --help` stays
fast."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def run_serve(args: argparse.Namespace) -> int:
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


def _lengths(args: argparse.Namespace) -> dict[str, int]:
    return {"input_len": min(args.input_len, 16) if args.tiny else args.input_len,
            "output_len": min(args.output_len, 8) if args.tiny else args.output_len}


def run_ar(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import ar

    cfg = ar.ARBenchConfig(
        preset="tiny" if args.tiny else (args.preset or "qwen3-0.6b"), **_lengths(args),
        concurrency=args.concurrency, device=args.device,
        max_num_batched_tokens=args.max_num_batched_tokens,
        checkpoint_dir=args.checkpoint_dir, seed=args.seed)
    result = ar.run(cfg)
    return (result, f"ar_{cfg.preset}_c{'-'.join(map(str, cfg.concurrency))}",
            {c: r["throughput_ratio"] for c, r in result["by_concurrency"].items()})


def run_ar_tp(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import ar_tp

    cfg = ar_tp.ARTPBenchConfig(
        preset="tiny" if args.tiny else (args.preset or "qwen3-8b"),
        tensor_parallel_size=args.tensor_parallel_size, **_lengths(args),
        concurrency=args.concurrency if args.concurrency != (1, 8, 64) else (1, 64),
        device=args.device, checkpoint_dir=args.checkpoint_dir, seed=args.seed)
    result = ar_tp.run(cfg)
    return result, f"ar_tp{cfg.tensor_parallel_size}_{cfg.preset}", result["ratios"]


def run_omni(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import omni

    if args.layouts:
        return run_omni_layouts(args)

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


def run_omni_layouts(args: argparse.Namespace) -> Outcome:
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


def run_tts(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import tts

    cfg = tts.TTSBenchConfig.preset(
        "tiny" if args.tiny else "1.7b", frames=args.frames, backend=args.backend,
        concurrency=args.concurrency, reference_requests=args.reference_requests,
        first_chunk_frames=args.first_chunk_frames, device=args.device, seed=args.seed,
        stage_overrides=tuple(args.stage_override))
    result = tts.run(cfg)
    return result, f"tts_qwen3-tts-{cfg.sizes}", result["ratios"]


def run_speech(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import speech

    cfg = speech.SpeechBenchConfig(
        family=args.family, tiny=args.tiny, length=args.length, concurrency=args.concurrency,
        c1_requests=args.c1_requests, device=args.device, backend=args.backend,
        seed=args.seed, stage_overrides=tuple(args.stage_override))
    result = speech.run(cfg)
    return result, f"speech_{cfg.family}-{'tiny' if cfg.tiny else 'real'}", result["ratios"]


def run_realtime(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import realtime

    cfg = realtime.RealtimeBenchConfig(
        sizes="tiny" if args.tiny else "bench", concurrency=args.concurrency, turns=args.turns,
        utterance_s=args.utterance_s, device=args.device, seed=args.seed,
        thinker_tokens=args.thinker_tokens or (4 if args.tiny else 32),
        talker_tokens=args.talker_tokens, turn_taking=realtime.TurnTakingConfig(
            modes=args.turn_modes, repeats=args.turn_repeats,
            silence_duration_ms=args.silence_duration_ms, eagerness=args.eagerness))
    result = realtime.run(cfg)
    return result, f"realtime_qwen3-omni-{cfg.sizes}", result["ratios"]



def run_duplex(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import duplex
    from omnistage.benchmarks.common import write_result

    def given(value: object, tiny: object, full: object) -> object:
        return value if value is not None else tiny if args.tiny else full

    cfg = duplex.DuplexBenchConfig(
        sizes="tiny" if args.tiny else "7b",
        sessions=given(args.sessions, (1, 2), (1, 4, 8, 16, 24, 32)),
        ticks=given(args.ticks, 8, 200), warmup_ticks=given(args.warmup_ticks, 2, 10),
        device=args.device, seed=args.seed)
    name = args.name or f"duplex_moshi-{cfg.sizes}"
    result = duplex.run(cfg, lambda r: write_result(r, Path(args.out_dir), name))
    return result, name, result["ratios"]


def run_agent(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import agent

    cfg = agent.config_from(args.llm, args.tiny, args.llm_tokens, args.talker_frames,
                            args.concurrency, args.device)
    result = agent.run(cfg)
    return result, f"agent_{'tiny' if cfg.tiny else cfg.llm}", result["ratios"]


def run_diffusion_parallel(args: argparse.Namespace) -> Outcome:
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


def run_diffusion(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import diffusion

    cfg = diffusion.DiffusionBenchConfig.preset(
        "tiny" if args.tiny else "qwen-image", device=args.device, seed=args.seed,
        size=args.size, steps=args.steps, num_layers=args.num_layers,
        text_len=args.text_len or 64, cache_thresholds=args.cache_thresholds,
        concurrency=args.concurrency, compile=args.compile, quantization=args.quantization)
    from omnistage.benchmarks.diffusion_fp8 import bench_fp8
    from omnistage.benchmarks.diffusion_gguf import bench_gguf

    gguf = cfg.quantization and diffusion.split_quantization(cfg.quantization)[0] == "gguf"
    result = diffusion.run(cfg, fp8=bench_gguf if gguf else bench_fp8)
    # fp8, or transformer=fp8,attention=fp8 -> _transformer-fp8_attention-fp8
    suffix = ("_" + cfg.quantization.replace("=", "-").replace(",", "_")
              if cfg.quantization else "")
    return result, f"diffusion_{cfg.sizes}_{cfg.size}px{suffix}", result["ratios"]


def run_diffusion_variants(args: argparse.Namespace) -> Outcome:
    from omnistage.benchmarks import diffusion_variants as dv

    cfg = dv.VariantsConfig(model=args.model, tiny=args.tiny, size=args.size, steps=args.steps,
                            text_len=args.text_len, start_times=args.start_times,
                            device=args.device, seed=args.seed)
    result = dv.run(cfg)
    tiny = "_tiny" if cfg.tiny else ""
    return result, f"diffusion_variants_{cfg.model}{tiny}_{cfg.pixels}px", result["ratios"]


def run_diffusion_flux2(args: argparse.Namespace) -> Outcome:
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


def run_video(args: argparse.Namespace) -> Outcome:
    if args.parallel:
        return run_video_parallel(args)
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


def run_video_parallel(args: argparse.Namespace) -> Outcome:
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


def run_regress(args: argparse.Namespace) -> Outcome:
    import torch

    from omnistage.benchmarks import regress
    from omnistage.utils.device import resolve_device

    device = resolve_device(args.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = regress.run(tuple(p for p in args.probes.split(",") if p), args.device, gpu,
                         repeats=args.repeats, folder=Path(args.baseline_dir),
                         update=args.update_baseline, tolerance=args.tolerance,
                         tiny=args.tiny)
    result["device_name"] = gpu
    for line in result["verdicts"]:
        print(line)
    return result, "regress_" + Path(result["baseline"]).stem, result["regressed"]

