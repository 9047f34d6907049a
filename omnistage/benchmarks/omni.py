"""Qwen3-Omni (thinker -> talker -> code2wav) on our stage runtime against transformers'
`generate(return_audio=True)`, on a random-weight checkpoint built in the run.

    transformers:  one request at a time (its generate takes one conversation); the waveform
                   comes back whole, so its first audio = its end-to-end time; a queue of c
                   requests takes c times as long (estimated from `reference_requests` runs)
    ours:          the default graph (stage processes, shm connector, streamed edges): at
                   concurrency 1 requests one after another, at c all submitted at once;
                   per request: first audio chunk (time to the first event carrying audio),
                   end-to-end latency, real-time factor = latency / seconds of audio

Both sides: greedy thinker and talker (repetition penalty 1.05, the reference's default),
exactly `thinker_tokens` text tokens and `talker_tokens` codec frames (eos ignored / min new
tokens), speaker Ethan, text-only prompts (chat template applied).

Sizes ("real"): Qwen3-Omni-30B-A3B at its size: thinker 48 layers of 128 experts and its
152k vocabulary, talker 20 layers of 128 experts, the rest as "bench" (audio and vision
encoders small: text prompts do not use them). With `tensor_parallel_size` N our thinker
spans GPUs 0..N-1 (the default graph under `-tp N`: talker and code2wav on GPU 0), and
transformers loads the saved checkpoint on GPU 0 where it fits, else spread over the same GPUs
(device_map="auto"; see omni_checkpoint.spread).

Sizes ("bench"): Qwen3-Omni-30B-A3B's layer structure (MoE thinker and talker, 5-layer code
predictor, code2wav with its real upsampling to 24 kHz) scaled to fit one GPU and run in
seconds: thinker 12 of 48 layers and 32 of 128 experts (hidden 2048, 32 heads, 4 KV heads,
top-8, expert width 768, as the real one), talker 8 of 20 layers and 32 of 128 experts
(hidden 1024, shared expert), 16 codebooks, code2wav at the transformers defaults. Vocabulary:
the tiny test tokenizer's (424 ids, not 152k); audio / vision encoders tiny (text prompts do not
use them). Weights: transformers' own init.
"""

from __future__ import annotations

import queue
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from omnistage.benchmarks.common import (environment, free_device_memory, now, parameter_bytes,
                                         ratio, summary)
from omnistage.benchmarks.omni_checkpoint import (BENCH_SIZES, REAL_SIZES, build_checkpoint,
                                                  spread)
from omnistage.outputs import StageMetrics
from omnistage.payloads import AudioChunk
from omnistage.utils.device import resolve_device

SAMPLE_RATE = 24000
PROMPTS = ("Hello, what is the weather like today in the city?",
           "Please tell me a short story about the sea and a boat.",
           "What is the capital of France, and why is it famous?",
           "Describe a sunny morning in the mountains in a few words.",
           "How do I cook rice so that it does not stick together?",
           "Tell me something interesting about the moon and the stars.",
           "What should I take with me on a long walk in the forest?",
           "Explain in simple words how a bicycle keeps its balance.")

MODELS = ("qwen3-omni", "qwen2.5-omni")    # qwen2.5-omni: omni25.py


@dataclass(frozen=True, slots=True)
class OmniBenchConfig:
    sizes: str = "bench"                  # bench | real | tiny
    model: str = "qwen3-omni"             # one of MODELS
    thinker_tokens: int = 64
    talker_tokens: int = 100              # codec frames; 12.5 a second of audio
    concurrency: tuple[int, ...] = (1, 8, 32)
    reference_requests: int = 3
    device: str = "auto"
    backend: str = "process"              # stage backend of our runtime
    chunk_frames: int = 25                # code2wav's streaming chunk (the default graph's)
    stage_config: str | None = None       # our graph (default: the model's, qwen3_omni)
    tensor_parallel_size: int = 1         # our thinker's; transformers over as many GPUs
    stage_overrides: tuple[str, ...] = ()  # STAGE.KEY=VALUE on our graph (replicas, ...)
    ray_address: str | None = None        # backend ray: the cluster (None: start or join one)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sizes not in ("bench", "real", "tiny"):
            raise ValueError(f"sizes={self.sizes!r}: choose bench, real or tiny")
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}: choose {' or '.join(MODELS)}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: must be >= 1")
        if self.thinker_tokens < 1 or self.talker_tokens < 2:
            raise ValueError(f"thinker_tokens={self.thinker_tokens}, talker_tokens="
                             f"{self.talker_tokens}: need >= 1 and >= 2")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency={self.concurrency}: need values >= 1")
        if self.reference_requests < 0:
            raise ValueError(f"reference_requests={self.reference_requests}: must be >= 0 "
                             "(0: ours only, no ratios against transformers)")
        if self.chunk_frames < 1:
            raise ValueError(f"chunk_frames={self.chunk_frames}: must be >= 1")
        if self.backend not in ("process", "inproc", "ray"):
            raise ValueError(f"backend={self.backend!r}: choose process, inproc or ray")

    @classmethod
    def preset(cls, sizes: str, *, thinker_tokens: int | None = None,
               talker_tokens: int | None = None, backend: str | None = None,
               chunk_frames: int | None = None, **kw: object) -> OmniBenchConfig:
        tiny = sizes == "tiny"
        return cls(sizes=sizes, thinker_tokens=thinker_tokens or (6 if tiny else 64),
                   talker_tokens=talker_tokens or (12 if tiny else 100),
                   backend=backend or ("inproc" if tiny else "process"),
                   chunk_frames=chunk_frames or (8 if tiny else 25), **kw)


def _spread_reference(path: Path, cfg: OmniBenchConfig, device: torch.device,
                      dtype: torch.dtype) -> dict[str, object]:
    """transformers on the saved checkpoint, loaded by `spread` and timed (bench_transformers)
    in a child process, whose exit gives all its GPU memory back before ours loads (measured:
    in this process 64 GB stayed on GPU 0 after `del`, gc and emptying every parameter)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_spread_reference_child, (path, cfg, device, dtype))


def _spread_reference_child(path: Path, cfg: OmniBenchConfig, device: torch.device,
                            dtype: torch.dtype) -> dict[str, object]:
    model = spread(path, cfg.tensor_parallel_size, dtype)
    hf = bench_transformers(model, path, cfg, device)
    hf["device_map"] = sorted({str(d) for d in getattr(model, "hf_device_map", {}).values()})
    return hf


def _prompt(i: int) -> dict:
    return {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}


# ---- transformers -------------------------------------------------------------------------

def bench_transformers(model, path: Path, cfg: OmniBenchConfig, device: torch.device
                       ) -> dict[str, object]:
    from omnistage.models.qwen3_omni.processing import InputProcessor

    processor = InputProcessor.from_pretrained(path)
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def one(i: int, thinker_tokens: int, talker_tokens: int) -> tuple[float, int, int]:
        inputs = {k: v.to(device) for k, v in processor.parse_request(_prompt(i))
                  .hf_kwargs().items()}
        t0 = now(device)
        with torch.no_grad():
            seq, wav = model.generate(
                **inputs, return_audio=True, thinker_do_sample=False,
                thinker_max_new_tokens=thinker_tokens, thinker_min_new_tokens=thinker_tokens,
                thinker_eos_token_id=eos, talker_do_sample=False,
                talker_max_new_tokens=talker_tokens, talker_min_new_tokens=talker_tokens)
        seconds = now(device) - t0
        return seconds, seq.shape[1] - inputs["input_ids"].shape[1], wav.numel()

    one(0, cfg.thinker_tokens, cfg.talker_tokens)         # warm-up, at full length
    runs = [one(i, cfg.thinker_tokens, cfg.talker_tokens) for i in range(cfg.reference_requests)]
    return {**one_at_a_time([r[0] for r in runs], [r[2] / SAMPLE_RATE for r in runs],
                            cfg.concurrency), "text_tokens": [r[1] for r in runs]}


def one_at_a_time(e2e: list[float], audio_s: list[float], concurrency: tuple[int, ...]
                  ) -> dict[str, object]:
    """A reference that runs one request at a time and returns the waveform whole (its first
    audio = its end-to-end time), from measured requests: at concurrency c the k-th request
    waits for the k-1 before it, so makespan and mean latency are estimated from the mean."""
    mean_e2e = sum(e2e) / len(e2e)
    by_c = {str(c): {"makespan_s_estimated": c * mean_e2e,
                     "mean_latency_s_estimated": (c + 1) / 2 * mean_e2e,
                     "audio_s_per_s": sum(audio_s) / sum(e2e)} for c in concurrency}
    return {"requests": len(e2e), "e2e_s": summary(e2e), "first_audio_s": summary(e2e),
            "rtf": summary([t / a for t, a in zip(e2e, audio_s)]), "audio_s": audio_s,
            "by_concurrency": by_c}


# ---- ours ---------------------------------------------------------------------------------

def run_requests(omni, prompts: list, params: object, tag: str, timeout_s: float = 600.0
              ) -> list[dict[str, float]]:
    """Submit all `prompts` at once and wait; per request: first audio, e2e, audio seconds,
    text tokens (stamped in the router thread as events arrive)."""
    events: queue.Queue = queue.Queue()
    start: dict[str, float] = {}
    wall: dict[str, float] = {}
    for i, p in enumerate(prompts):
        rid = f"{tag}-{i}"
        start[rid] = time.perf_counter()
        wall[rid] = time.time()
        omni.engine.submit(p, params, request_id=rid,
                           sink=lambda ev: events.put((time.perf_counter(), ev)))
    stats = {rid: {"first_audio_s": None, "e2e_s": None, "audio_samples": 0, "text_tokens": 0}
             for rid in start}
    pending = set(start)
    deadline = time.monotonic() + timeout_s
    while pending:
        t, ev = events.get(timeout=max(1.0, deadline - time.monotonic()))
        s = stats[ev.request_id]
        if ev.error:
            raise RuntimeError(f"omnistage request {ev.request_id} failed: {ev.error}")
        if ev.stage == "thinker":
            s["text_tokens"] += len(ev.token_ids)
        chunk = AudioChunk.unpack(ev.tensors or {})
        audio = None if chunk is None else chunk.samples
        if audio is not None and audio.numel():
            s["audio_samples"] += audio.numel()
            if s["first_audio_s"] is None:
                s["first_audio_s"] = t - start[ev.request_id]
        if ev.done:
            s["e2e_s"] = t - start[ev.request_id]
            s["stages"] = _stage_times(ev.stage_metrics or {}, wall[ev.request_id])
            pending.discard(ev.request_id)
    return list(stats.values())


def _loop_stats(omni) -> dict[str, dict[str, float | int]]:
    return {name: dict(st.loop) for name, st in omni.engine.orchestrator.stage_stats().items()}


def _loop_delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Per stage, its busy loop's work between two readings (maxima: since start-up)."""
    return {name: {k: v if k.startswith("max_") else v - before.get(name, {}).get(k, 0)
                   for k, v in loop.items()} for name, loop in after.items()}


def _stage_times(metrics: dict[str, StageMetrics], submitted: float
                 ) -> dict[str, float | None]:
    """Per stage, seconds from submission to its first output and to its end (wall clocks of
    the stage processes): where a request's first audio waited."""
    times: dict[str, float | None] = {}
    for stage, m in metrics.items():
        first = m.first_output_time
        times[f"{stage}_first_s"] = None if first is None else first - submitted
        if m.finished_time is not None:
            times[f"{stage}_end_s"] = m.finished_time - submitted
        optional = {"model": m.model_seconds,         # generation: forwards it was part of
                    "queue": m.queue_time,            # until its first scheduled step
                    "prompt_rows": m.prompt_rows_time,    # the talker: its prompt's rows in,
                    "prompt_ready": m.prompt_ready_time}  # handed to the engine
        times.update({f"{stage}_{k}_s": v for k, v in optional.items() if v is not None})
    return times


def bench_ours(path: Path, cfg: OmniBenchConfig, device: torch.device, dtype: torch.dtype,
               overrides: list[str] | None = None) -> dict[str, object]:
    """`overrides` of the graph (default: Qwen3-Omni's code2wav chunk, the config's)."""
    from omnistage import Omni, SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=cfg.thinker_tokens, ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.05,
                             max_tokens=cfg.talker_tokens, ignore_eos=True), None]
    kw: dict[str, object] = {"backend": "inproc", "connector": "inproc"} \
        if cfg.backend == "inproc" else {"backend": cfg.backend, "ray_address": cfg.ray_address}
    if overrides is None:
        overrides = [f"code2wav.generation.options.chunk_frames={cfg.chunk_frames}", *cfg.stage_overrides]
    t0 = time.perf_counter()
    if cfg.tensor_parallel_size > 1:
        kw["tensor_parallel_size"] = cfg.tensor_parallel_size
    with Omni(str(path), stage_config=cfg.stage_config, device=str(device),
              dtype=str(dtype).removeprefix("torch."), stage_overrides=overrides, **kw) as omni:
        startup = time.perf_counter() - t0
        run_requests(omni, [_prompt(0)], params, "warm")           # at full length
        warm = [replace(params[0], max_tokens=2), replace(params[1], max_tokens=4), None]
        run_requests(omni, [_prompt(i) for i in range(max(cfg.concurrency))], warm, "warm-batch")
        by_c = measure_concurrency(omni, _prompt, params, cfg.concurrency,
                                   cfg.reference_requests or 2)
    return {"startup_s": startup, "by_concurrency": by_c}


def measure_concurrency(omni, prompt: Callable[[int], object], params: object,
                        concurrency: tuple[int, ...], sequential: int) -> dict[str, dict]:
    """Per concurrency c, our requests' first audio, end-to-end time, real-time factor and audio
    seconds per second: at c = 1 `sequential` requests one after another, else c at once
    (`prompt(i)`: request i's prompt); with where the first audio waited and each stage's
    busy-loop work."""
    by_c = {}
    for c in concurrency:
        loop0 = _loop_stats(omni)
        if c == 1:
            stats = [s for i in range(sequential)
                     for s in run_requests(omni, [prompt(i)], params, f"c1-{i}")]
            makespan = sum(s["e2e_s"] for s in stats)
        else:
            t1 = time.perf_counter()
            stats = run_requests(omni, [prompt(i) for i in range(c)], params, f"c{c}")
            makespan = time.perf_counter() - t1
        audio_s = [s["audio_samples"] / SAMPLE_RATE for s in stats]
        by_c[str(c)] = {
            "requests": len(stats), "makespan_s": makespan,
            "first_audio_s": summary([s["first_audio_s"] for s in stats
                                      if s["first_audio_s"] is not None]),
            "e2e_s": summary([s["e2e_s"] for s in stats]),
            "rtf": summary([s["e2e_s"] / a for s, a in zip(stats, audio_s) if a > 0]),
            "audio_s_per_s": sum(audio_s) / makespan,
            "stages": {k: summary([s["stages"][k] for s in stats
                                   if s["stages"].get(k) is not None])
                       for k in sorted({k for s in stats for k in s["stages"]})},
            "audio_s": audio_s, "text_tokens": [s["text_tokens"] for s in stats],
            "stage_loops": _loop_delta(loop0, _loop_stats(omni))}
    return by_c


def audio_ratios(ours: dict[str, dict], ref: dict | None, concurrency: tuple[int, ...],
                 reference: str, prefix: str = "") -> dict[str, float | None]:
    """The figures a speech benchmark is judged by, from our rows per concurrency and the
    reference's (`one_at_a_time`; None: ours only): real-time factor, the concurrency cliff
    (first audio at c against alone), and against the reference its end-to-end time, audio
    throughput and queued latency. `reference` and `prefix` go into the names."""
    one = ours.get("1")
    ratios: dict[str, float | None] = {}
    if one is not None and ref is not None:
        ratios[f"{prefix}first_audio_over_{reference}_e2e_c1"] = ratio(
            one["first_audio_s"]["median"], ref["e2e_s"]["median"])
        ratios[f"{prefix}e2e_speedup_c1"] = ratio(ref["e2e_s"]["median"], one["e2e_s"]["median"])
    for c in concurrency:
        mine = ours[str(c)]
        ratios[f"{prefix}rtf_c{c}"] = mine["rtf"]["median"]
        if ref is not None:
            theirs = ref["by_concurrency"][str(c)]
            ratios[f"{prefix}audio_throughput_ratio_c{c}"] = ratio(mine["audio_s_per_s"],
                                                                  theirs["audio_s_per_s"])
            if c > 1:
                ratios[f"{prefix}first_audio_over_{reference}_queue_latency_c{c}"] = ratio(
                    mine["first_audio_s"]["median"], theirs["mean_latency_s_estimated"])
        if c > 1 and one is not None:   # the concurrency cliff: first audio at c against alone
            ratios[f"{prefix}first_audio_c{c}_over_c1"] = ratio(mine["first_audio_s"]["median"],
                                                               one["first_audio_s"]["median"])
    return ratios


# ---- the run ------------------------------------------------------------------------------

def run(cfg: OmniBenchConfig) -> dict[str, object]:
    """Qwen3-Omni's bench (qwen2.5-omni: omni25.run, which builds on this module)."""
    assert cfg.model == "qwen3-omni", f"{cfg.model}: omni25.run"
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-omni-") as tmp:
        path = Path(tmp) / "qwen3-omni"
        model = build_checkpoint(cfg.sizes, path, device, dtype)
        params = {"thinker": parameter_bytes(model.thinker) // model.dtype.itemsize,
                  "talker": parameter_bytes(model.talker) // model.dtype.itemsize,
                  "code2wav": parameter_bytes(model.code2wav) // model.dtype.itemsize}
        spread = ((cfg.tensor_parallel_size > 1 or cfg.sizes == "real")
                  and device.type == "cuda" and cfg.reference_requests)
        if spread:              # the model as built leaves the GPUs first
            del model
            free_device_memory(device)
            hf = _spread_reference(path, cfg, device, dtype)
        else:
            hf = bench_transformers(model, path, cfg, device) if cfg.reference_requests else None
            del model
        free_device_memory(device)
        ours = bench_ours(path, cfg, device, dtype)
        free_device_memory(device)

    ratios = audio_ratios(ours["by_concurrency"], hf, cfg.concurrency, "transformers")
    return {
        "benchmark": "omni", **environment(device), "dtype": str(dtype).removeprefix("torch."),
        "config": {**asdict(cfg), "sizes_changed": "omnistage.testing.tiny_omni"
                   if cfg.sizes == "tiny" else BENCH_SIZES,
                   "real_sizes": REAL_SIZES if cfg.sizes == "real" else None,
                   "parameters": params},
        "reference": hf, "omnistage": ours, "ratios": ratios,
        "notes": "reference: transformers' generate(return_audio=True). first_audio: "
                 "seconds from submission to the first audio chunk (transformers returns the "
                 "waveform whole: its end-to-end time). rtf: end-to-end seconds per second of "
                 "audio (below 1: faster than real time). transformers at concurrency c: "
                 "requests run one by one, makespan and mean latency estimated from the "
                 "measured per-request time.",
    }
