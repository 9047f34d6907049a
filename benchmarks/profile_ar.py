"""cProfile of the AR engine's offline loop on a random-weight checkpoint (see bench_ar.py):
where the host time of a step goes."""

from __future__ import annotations

import cProfile
import pstats
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_ar import PRESETS, build_checkpoint  # noqa: E402

from omnistage.ar.engine import AREngine  # noqa: E402
from omnistage.configs.schema import ARConfig, KVCacheConfig, SchedulerConfig  # noqa: E402
from omnistage.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    preset, n, input_len, output_len = "qwen3-0.6b", 64, 256, 64
    path = build_checkpoint(preset, Path("/tmp/omnistage-bench") / preset)
    engine = AREngine(ARConfig(model=str(path), device="cuda", dtype="bfloat16",
                               kv_cache=KVCacheConfig(memory_fraction=0.5),
                               scheduler=SchedulerConfig(max_num_seqs=n,
                                                         max_num_batched_tokens=4096)))
    rng = random.Random(0)
    vocab = PRESETS[preset]["vocab_size"]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            detokenize=False)
    for i in range(n):
        engine.add_request(f"w{i}", [rng.randrange(vocab) for _ in range(input_len)], params)
    while engine.has_unfinished_requests:
        engine.step()
    for i in range(n):
        engine.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(input_len)], params)
    prof = cProfile.Profile()
    prof.enable()
    while engine.has_unfinished_requests:
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumtime").print_stats(25)


if __name__ == "__main__":
    main()
