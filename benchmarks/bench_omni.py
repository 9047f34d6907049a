"""`omnistage bench omni` as a script, with the same options:

    python benchmarks/bench_omni.py [--tiny] [--device cuda] [--out-dir benchmarks/results]

Qwen3-Omni-shaped pipeline against transformers' generate(return_audio=True): first audio chunk,
real-time factor, end-to-end latency at concurrency 1, 8 and 32. Method and sizes:
omnistage/benchmarks/omni.py.
"""

from __future__ import annotations

import sys

from omnistage.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "omni", *sys.argv[1:]]))
