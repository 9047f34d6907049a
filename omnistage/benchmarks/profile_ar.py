"""Where the time of an AR engine step goes, on a random-weight checkpoint (see ar_offline.py):
a cProfile of the offline loop (host time per function), then the device time of one decode
step's CUDA-graph replay per batch size, against the wall time of a whole engine step.

    python -m omnistage.benchmarks.profile_ar --num-prompts 64 --output-len 64 [--enforce-eager]

The gap between the two last numbers is host time the GPU waits for (scheduler, batch to
tensors, sampling, outputs).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time
from pathlib import Path


from omnistage.benchmarks.ar_offline import PRESETS, build_checkpoint, make_engine, run_engine


def replay_ms(graphs, bs: int, iters: int = 50) -> float:  # graphs: DecodeGraphs
    """Median device time of one replay of the bucket-`bs` graph (its inputs as left)."""
    from omnistage.benchmarks.common import replay_time_us

    return replay_time_us(graphs.graphs[(bs, (), False)][0], iters) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESETS))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()

    path = build_checkpoint(args.preset, Path("/tmp/omnistage-bench") / args.preset)
    engine = make_engine(path, args.num_prompts, 4096, args.enforce_eager)
    rng = random.Random(0)
    vocab = PRESETS[args.preset]["vocab_size"]

    def prompts() -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(args.input_len)]
                for _ in range(args.num_prompts)]

    run_engine(engine, prompts(), args.output_len, "w")
    prof = cProfile.Profile()
    prof.enable()
    elapsed, times, _ = run_engine(engine, prompts(), args.output_len, "r")
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(args.top)

    # wall time per decode step: the last half of the run is decode only
    steps = sorted(t for ts in times.values() for t in ts[len(ts) // 2:])
    per_step = (steps[-1] - steps[0]) / (args.output_len - args.output_len // 2 - 1)
    print(f"wall {elapsed:.3f} s for {args.num_prompts} x {args.output_len} tokens; "
          f"decode step {per_step * 1e3:.3f} ms (engine.step, wall)")
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is not None:
        bs = next(s for s in graphs.sizes if s >= args.num_prompts)
        t0 = time.perf_counter()
        gpu = replay_ms(graphs, bs)
        print(f"graph replay, batch {bs}: {gpu:.3f} ms on the device "
              f"({time.perf_counter() - t0:.2f} s to measure)")
        for b in graphs.sizes[:4]:
            print(f"  batch {b}: {replay_ms(graphs, b):.3f} ms")


if __name__ == "__main__":
    main()
