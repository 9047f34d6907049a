"""`omnistage bench diffusion` as a script, with the same options:

    python benchmarks/bench_diffusion.py [--tiny] [--device cuda] [--out-dir benchmarks/results]

Qwen-Image-shaped transformer against diffusers at 1024x1024, 20 steps; step caching (speed-up,
PSNR); step-level batching at concurrency 4. Method: omnistage/benchmarks/diffusion.py.
"""

from __future__ import annotations

import sys

from omnistage.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "diffusion", *sys.argv[1:]]))
