"""The flags of `omnistage bench KIND` (bench.py has the commands): the options every benchmark
takes, then each kind's own; `bench serve` takes `vllm bench serve`'s names."""

from __future__ import annotations

import argparse
from collections.abc import Callable

Runner = Callable[[argparse.Namespace], int]


def add_kinds(p: argparse.ArgumentParser, func: Runner) -> None:
    """One sub-command a benchmark kind under `p`, each answered by `func`."""
    kinds = p.add_subparsers(dest="benchmark", required=True)
    for add in (_add_ar, _add_omni, _add_tts, _add_speech, _add_diffusion, _add_video,
                _add_realtime, _add_duplex, _add_agent, _add_regress):
        _common(add(kinds), func)
    _add_serve(kinds, func)


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
        items.append(f"{stage}.placement.replicas={count}")
    return tuple(items)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers")


def _names(text: str) -> tuple[str, ...]:
    return tuple(name for name in text.split(",") if name)


def _common(q: argparse.ArgumentParser, func: Runner) -> None:
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
    q.set_defaults(func=func)


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
    tts.add_argument("--stage-override", action="append", default=[],
                     metavar="STAGE.KEY=VALUE",
                     help="a key of our graph's stages, as serve takes it (repeatable)")
    return tts


def _add_speech(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    sp = kinds.add_parser("speech", help="CosyVoice3, Voxtral-TTS or MiMo-Audio: the served "
                                         "graph at the released shape (no reference run)")
    sp.add_argument("--family", required=True,
                    choices=["cosyvoice3", "voxtral-tts", "mimo-audio"])
    sp.add_argument("--length", type=int, default=None,
                    help="speaking-stage steps per request: speech tokens (cosyvoice3, "
                         "default 100 = 4 s), frames (voxtral-tts, 50 = 4 s), LLM patches "
                         "(mimo-audio, 25 = 4 s); tiny 12 / 8 / 6")
    sp.add_argument("--concurrency", type=_ints, default=(1, 8, 32))
    sp.add_argument("--c1-requests", type=int, default=3,
                    help="requests at concurrency 1, one after another")
    sp.add_argument("--backend", choices=["process", "inproc"], default=None,
                    help="stage backend (default: process; inproc with --tiny)")
    sp.add_argument("--stage-override", action="append", default=[],
                    metavar="STAGE.KEY=VALUE",
                    help="a key of the family's graph, as serve takes it (repeatable)")
    return sp


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
    diff.add_argument("--quantization", default=None, metavar="SPEC",
                      help="also our transformer with FP8 (a GPU of compute capability 8.9+) "
                           "or INT8 W8A8 linears (--tiny: on the CPU): fp8, int8, or "
                           "transformer=fp8|int8 and/or attention=fp8 (FP8 attention); speed "
                           "against diffusers eager and compiled, image and latent PSNR "
                           "against our bf16, with and without step caching; gguf: its "
                           "linears as GGUF Q8_0 and Q4_0 blocks (PSNR, memory, speed)")
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
    rt.add_argument("--turn-modes", type=_names, default=("server_vad", "semantic_vad"),
                    help="turn_detection modes whose turn-taking is timed, comma-separated "
                         "(none: the empty string)")
    rt.add_argument("--turn-repeats", type=int, default=3, help="spoken turns per mode")
    rt.add_argument("--silence-duration-ms", type=int, default=500,
                    help="server_vad's silence_duration_ms (the server's default)")
    rt.add_argument("--eagerness", default="auto", choices=("low", "medium", "high", "auto"),
                    help="semantic_vad's eagerness (the server's default)")
    return rt



def _add_duplex(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    dx = kinds.add_parser("duplex", help="full-duplex Moshi (7B shape) on the duplex runtime: "
                                         "sessions a GPU ticks within 80 ms, missed ticks")
    dx.add_argument("--sessions", type=_ints, default=None,
                    help="sessions at once, comma-separated (default 1,4,8,16,24,32; tiny 1,2)")
    dx.add_argument("--ticks", type=int, default=None,
                    help="measured ticks per session, 12.5 a second (default 200; tiny 8)")
    dx.add_argument("--warmup-ticks", type=int, default=None,
                    help="ticks of each N left out of the figures (default 10; tiny 2)")
    return dx


def _add_agent(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    ag = kinds.add_parser("agent", help="the voice agent (a text LLM -> Qwen3-TTS 1.7B): first "
                                        "audio from the request at 1 and 8 requests")
    ag.add_argument("--llm", default="qwen3-8b", choices=["qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"],
                    help="the LLM's published shape (random weights)")
    ag.add_argument("--llm-tokens", type=int, default=None,
                    help="tokens an answer (default 64; tiny 12)")
    ag.add_argument("--talker-frames", type=int, default=None,
                    help="the most talker frames an answer (default 200; tiny 24)")
    ag.add_argument("--concurrency", type=_ints, default=(1, 8))
    return ag


def _add_serve(kinds: argparse._SubParsersAction, func: Runner) -> None:
    """Flags named as `vllm bench serve`'s; none of the common ones (no model runs here)."""
    from omnistage.benchmarks.serve_config import ALIASES, METRICS, ROUTES

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
    sv.set_defaults(func=func)


def _add_regress(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    reg = kinds.add_parser("regress", help="rerun the headline figures and hold them to this "
                                           "GPU's committed baseline (exit 1 on a drop)")
    reg.add_argument("--probes", default="ar,omni,omni25,tts",
                     help="comma-separated: ar, omni, omni25, tts, duplex, agent (default: "
                          "the first four; tts and agent need qwen-tts, as bench tts; duplex "
                          "builds a 15.5 GB Moshi)")
    reg.add_argument("--repeats", type=int, default=1,
                     help="runs of each probe: the best counts, the spread is reported as "
                          "noise (2 to measure it)")
    reg.add_argument("--tolerance", type=float, default=None,
                     help="how much worse a figure may be, e.g. 0.05 (default: the "
                          "baseline's, 5%%)")
    reg.add_argument("--baseline-dir", default="benchmarks/results/baselines",
                     help="where <gpu>.json baselines live")
    reg.add_argument("--update-baseline", action="store_true",
                     help="write today's figures as this GPU's baseline (on purpose: after a "
                          "change that is meant to move them)")
    return reg

