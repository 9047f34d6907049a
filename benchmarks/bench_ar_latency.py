"""`omnistage bench ar` as a script, with the same options:

    python benchmarks/bench_ar_latency.py [--tiny] [--device cuda] [--out-dir DIR]

AR engine against transformers' generate on a Qwen3-0.6B-shaped model: tokens/s, TTFT, TPOT at
concurrency 1, 8 and 64, and single-stream tokens/s against the weight-streaming limit. Method:
omnistage/benchmarks/ar.py.
"""

from __future__ import annotations

import sys

from omnistage.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "ar", *sys.argv[1:]]))
