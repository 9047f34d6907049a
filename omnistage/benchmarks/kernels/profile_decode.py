"""Per-kernel device time of AR engine decode steps (torch.profiler), on a random-weight
checkpoint of a real shape (see ar_offline.py) or a given one: which kernels a decode step
spends its time in, per step, summed by kernel name (on CPU: the ops' CPU time).

    python -m omnistage.benchmarks.kernels.profile_decode --batch 1 --out /tmp/kernels_bs1.json
    python -m omnistage.benchmarks.kernels.profile_decode --checkpoint /tmp/tiny --device cpu   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from omnistage.benchmarks.ar_offline import PRESETS, build_checkpoint


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESETS))
    ap.add_argument("--checkpoint", type=Path, help="profile this checkpoint instead")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-gemv", action="store_true",
                    help="without the one-row matrix-vector kernels (layers/triton_gemv.py)")
    ap.add_argument("--no-pdl", action="store_true", help="without programmatic dependent launch")
    ap.add_argument("--out", type=Path)
    return ap


def _kernel_rows(prof: profile, cuda: bool, steps: int) -> list[dict]:
    """Per kernel name (on CPU: per aten op), count and time a step, the largest first."""
    rows = []
    for ev in prof.key_averages():
        dev = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if dev <= 0 or (not cuda and not ev.key.startswith("aten::")):
            continue
        rows.append({"name": ev.key[:120], "count_per_step": ev.count / steps,
                     "us_per_step": dev / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


def main() -> None:
    from omnistage.ar.engine import AREngine
    from omnistage.configs.schema import ARConfig, SchedulerConfig
    from omnistage.sampling_params import SamplingParams

    args = _parser().parse_args()

    if args.no_gemv:
        from omnistage.layers import fused
        fused.set_gemv(False)
    if args.no_pdl:
        from omnistage.layers import pdl
        pdl.set_enabled(False)
    path = args.checkpoint or build_checkpoint(args.preset,
                                               Path("/tmp/omnistage-bench") / args.preset)
    cuda = args.device.startswith("cuda")
    engine = AREngine(ARConfig(
        model=str(path), device=args.device, dtype="bfloat16" if cuda else "float32",
        enforce_eager=args.enforce_eager, memory_fraction=0.5,
        scheduler=SchedulerConfig(max_num_seqs=max(args.batch, 1),
                                  max_num_batched_tokens=4096)))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True,
                            detokenize=False)
    for i in range(args.batch):
        engine.add_request(f"p{i}", [rng.randrange(vocab) for _ in range(args.input_len)],
                           params)
    for _ in range(20):           # prefill, then warm decode steps (graphs captured at start)
        engine.step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    rows = _kernel_rows(prof, cuda, args.steps)
    total = sum(r["us_per_step"] for r in rows)
    kernels = sum(r["count_per_step"] for r in rows)
    print(f"{'device' if cuda else 'CPU op'} time per step {total:.1f} us in {kernels:.0f} "
          f"{'kernels' if cuda else 'ops'} (batch {args.batch}, {path.name})")
    for r in rows[:40]:
        print(f"{r['us_per_step']:9.1f} us  x{r['count_per_step']:6.1f}  {r['name']}")
    graphs = getattr(engine.runner, "graphs", None)
    result = {"checkpoint": path.name, "batch": args.batch,
              "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "device_us_per_step": total,
              "kernels_per_step": kernels, "enforce_eager": args.enforce_eager,
              "gemv": not args.no_gemv, "pdl": not args.no_pdl,
              "graph_replays": getattr(graphs, "num_replays", None),
              "kernels": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
