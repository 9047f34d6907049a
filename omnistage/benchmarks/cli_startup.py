"""How long the command line takes to say something: `omnistage --help`, `omnistage serve
--help`, a mistyped flag and bare `omnistage`, each a fresh interpreter, median of N runs,
against a baseline checkout (our previous version) in the same run.

    git worktree add /tmp/omnistage-base bd5c582
    .venv/bin/python -m omnistage.benchmarks.cli_startup --baseline /tmp/omnistage-base \\
        --out benchmarks/results/cli_startup_cpu.json

Each command runs as `python -m omnistage.entrypoints.cli.main ARGS` with PYTHONPATH set to the
checkout, so both sides use this interpreter and its installed libraries.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]      # the checkout
COMMANDS = {"help": ["--help"], "serve_help": ["serve", "--help"],
            "typo": ["serve", "--max-num-seq", "3"], "bare": []}


def time_command(checkout: Path, args: list[str], runs: int) -> float:
    """Median seconds of `omnistage ARGS` from `checkout`, in fresh interpreters."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "omnistage.entrypoints.cli.main", *args],
                       env=env, cwd=checkout, capture_output=True, timeout=120)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="a checkout to compare with")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = p.parse_args()
    ours = {name: time_command(ROOT, argv, args.runs) for name, argv in COMMANDS.items()}
    base = {name: time_command(args.baseline, argv, args.runs) for name, argv in COMMANDS.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.baseline,
                            capture_output=True, text=True).stdout.strip()
    result = {"benchmark": "cli_startup", "machine": f"{platform.machine()} CPU, "
              f"{os.cpu_count()} cores (shared)", "runs": args.runs,
              "baseline_commit": commit or str(args.baseline),
              **{f"{name}_s": round(t, 3) for name, t in ours.items()},
              **{f"baseline_{name}_s": round(t, 3) for name, t in base.items()},
              **{f"{name}_speedup": round(base[name] / ours[name], 1) for name in ours}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
