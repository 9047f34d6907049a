"""Where a Qwen3-TTS talker step and a code2wav forward spend their time, outside the runtime
(no processes, no connector): the talker's stage engine stepped directly, per-step wall time
at batch sizes 1 and 8, and torch.profiler's kernel table for a few decode steps; then the
vocoder's first chunk and a steady chunk timed alone. On the random 1.7B checkpoint that
`omnistage bench tts` builds (its reference interpreter builds it; see tts.py).

    OMNISTAGE_TTS_REF_PYTHONPATH=/tmp/ref-site python -m omnistage.benchmarks.profile_tts --out /tmp/p.json
    python -m omnistage.benchmarks.profile_tts --sizes tiny --device cpu   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_profile(talker, params, device: torch.device) -> dict[str, object]:
    """One request's first step (its prompt's prefill, code 0, the code predictor)."""
    from omnistage.benchmarks.tts import TEXTS
    from omnistage.stages.interface import StageRequest

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    sync(device)
    with profile(activities=activities) as prof:
        talker.add(StageRequest("prefill", time.time(), params, prompt=TEXTS[0]))
        talker.step()
        sync(device)
    talker.abort("prefill")
    return kernel_table(prof, 1, device, top=15)


def talker_steps(talker, params, batch: int, steps: int, device: torch.device,
                 prof_steps: int) -> dict[str, object]:
    """Add `batch` requests, time their prefill step and `steps` decode steps; profile
    `prof_steps` more."""
    from omnistage.benchmarks.tts import TEXTS
    from omnistage.stages.interface import StageRequest

    rids = [f"b{batch}-{i}" for i in range(batch)]
    sync(device)
    t0 = time.perf_counter()
    for i, rid in enumerate(rids):
        talker.add(StageRequest(rid, time.time(), params, prompt=TEXTS[i % len(TEXTS)]))
    added = time.perf_counter()
    first = None
    while first is None or not any(r.payload for r in first):
        first = talker.step()
    sync(device)
    t_first = time.perf_counter()
    walls = []
    for _ in range(steps):
        s = time.perf_counter()
        talker.step()
        walls.append(time.perf_counter() - s)
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        for _ in range(prof_steps):
            talker.step()
        sync(device)
    for rid in rids:
        talker.abort(rid)
    return {"batch": batch, "add_s": added - t0, "first_frame_s": t_first - t0,
            "step_ms": {"median": 1e3 * statistics.median(walls), "min": 1e3 * min(walls),
                        "max": 1e3 * max(walls)},
            "profile": kernel_table(prof, prof_steps, device)}


def kernel_table(prof, steps: int, device: torch.device, top: int = 25) -> dict[str, object]:
    rows = []
    cuda = device.type == "cuda"
    for e in prof.key_averages():
        t = e.device_time_total if cuda else e.self_cpu_time_total
        if cuda and e.device_type.name != "CUDA":
            continue
        rows.append((t, e.count, e.key))
    rows.sort(reverse=True)
    total = sum(t for t, _, _ in rows)
    return {"device_ms_per_step": total / 1e3 / steps,
            "kernels_per_step": sum(c for _, c, _ in rows) / steps,
            "top": [{"name": k[:90], "ms_per_step": t / 1e3 / steps, "count_per_step": c / steps}
                    for t, c, k in rows[:top]],
            "cpu_top": [{"name": e.key[:90], "cpu_ms_per_step": e.cpu_time_total / 1e3 / steps}
                        for e in sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total)
                        [:15]]}


def vocoder(path: Path, device: torch.device, dtype: torch.dtype, repeats: int
            ) -> dict[str, object]:
    """code2wav alone: a stream's first chunk of n frames, and a steady 25-frame chunk after
    its left context, at 1 and 8 streams."""
    from omnistage.generation.code2wav import Code2WavGenerator, Code2WavOptions
    from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStream

    out: dict[str, object] = {}
    for first in (1, 2, 4, 6):
        gen = Code2WavGenerator.from_pretrained(path, "qwen3_tts_code2wav", device, dtype,
                                                Code2WavOptions(25, first_chunk_frames=first))
        q, size = gen.model.cfg.num_quantizers, gen.model.cfg.codebook_size
        for streams in (1, 8):
            times = []
            for r in range(repeats):
                states = [{} for _ in range(streams)]
                codes = torch.randint(0, size, (first, q))
                sync(device)
                t0 = time.perf_counter()
                gen.generate([{"codes": codes}] * streams, states, [False] * streams)
                sync(device)
                times.append(time.perf_counter() - t0)
            out[f"first{first}_x{streams}_ms"] = 1e3 * statistics.median(times[1:] or times)
    model = gen.model                                        # its parts, a 6-frame first chunk
    codes = torch.randint(0, size, (1, q, model.embed_context + 6), device=device)
    past = torch.zeros(1, *Code2WavStream(model, 25)._past.shape, dtype=dtype, device=device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    six = torch.full((1,), 6, dtype=torch.int32, device=device)
    parts = {"embed": lambda: model.embed(codes),
             "pre_transformer": lambda: model.pre_transformer.forward_cached(
                 model.embed(codes)[:, model.embed_context:], past, zero, six),
             "vocode": lambda: model.vocode(torch.zeros(1, 6, model.row_size, dtype=dtype,
                                                        device=device))}
    with torch.inference_mode():
        for name, fn in parts.items():
            times = []
            for _ in range(repeats):
                sync(device)
                t0 = time.perf_counter()
                fn()
                sync(device)
                times.append(time.perf_counter() - t0)
            out[f"part_{name}_ms"] = 1e3 * statistics.median(times[1:])
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                               if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            parts["pre_transformer"]()
            parts["vocode"]()
            sync(device)
    out["first6_profile"] = kernel_table(prof, 1, device, top=12)
    return out


def main() -> None:
    from omnistage import SamplingParams
    from omnistage.benchmarks.tts import VOICE, TTSBenchConfig, build_and_reference
    from omnistage.configs.defaults import resolve_graph
    from omnistage.stages.factory import build_stage_engine

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1.7b", choices=["1.7b", "tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prof-steps", type=int, default=10)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--override", action="append", default=[],
                    help="stage override, e.g. talker.ar.enforce_eager=true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result: dict[str, object] = {"device": torch.cuda.get_device_name(device)
                                 if device.type == "cuda" else "cpu",
                                 "overrides": args.override}
    with tempfile.TemporaryDirectory(prefix="omnistage-profile-tts-") as tmp:
        cfg = TTSBenchConfig(sizes=args.sizes, reference_requests=0, device=args.device)
        path, _ = build_and_reference(Path(tmp), cfg, device)
        graph = resolve_graph(str(path), path, None, args.override,
                              dtype=str(dtype).removeprefix("torch."))
        stage = next(s for s in graph.stages if s.name == "talker")
        t0 = time.perf_counter()
        talker = build_stage_engine(stage, str(path), args.device)
        result["talker_load_s"] = time.perf_counter() - t0
        speaker, language = VOICE[args.sizes]
        params = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=10_000,
                                ignore_eos=True, detokenize=False,
                                extra={"voice": speaker, "language": language})
        talker_steps(talker, params, 1, 5, device, 1)                     # warm
        result["prefill"] = prefill_profile(talker, params, device)
        result["talker"] = [talker_steps(talker, params, int(b), args.steps, device,
                                         args.prof_steps)
                            for b in args.batches.split(",")]
        del talker
        result["vocoder"] = vocoder(path, device, dtype, 5)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
