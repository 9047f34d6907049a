"""Run a function on the ranks of one stage as separate CPU processes over gloo, for tests of
parallel layouts (issue 18): `run_ranks("pkg.module:function", sizes, kwargs, out_dir)`.

Each rank is `python -m omnistage.testing.ranks`: it joins the group (layers/groups.py), calls
`function(ranks, **kwargs)` and writes what it returns (JSON) to `out_dir/rank{r}.json`. The
caller waits with a deadline, kills what lingers, and raises with a rank's stderr when one
failed.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from omnistage.layers.groups import ParallelSizes
from omnistage.testing.processes import free_port


def run_ranks(target: str, sizes: ParallelSizes, kwargs: dict, out_dir: Path,
              timeout_s: float = 240.0, backend: str = "gloo") -> list:
    """Every rank's return value, in rank order. RuntimeError naming the rank that failed.
    backend "nccl" (GPU tests): rank r runs on CUDA device r."""
    port = free_port()
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for r in range(sizes.world_size):
        with open(out_dir / f"err{r}", "w") as err:   # the child keeps its own descriptor
            args = [target, str(r), str(port), str(out_dir), json.dumps(asdict(sizes)),
                    json.dumps(kwargs), backend]
            procs.append(subprocess.Popen([sys.executable, "-m", "omnistage.testing.ranks",
                                           *args], stdout=subprocess.DEVNULL, stderr=err,
                                          env=env))
    wait_all(procs, timeout_s)
    for r, p in enumerate(procs):
        if p.returncode != 0:
            raise RuntimeError(f"rank {r} ended with {p.returncode}:\n"
                               + (out_dir / f"err{r}").read_text()[-3000:])
    return [json.loads((out_dir / f"rank{r}.json").read_text())
            for r in range(sizes.world_size)]


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait for every process until the deadline; kill (and reap) what is still running."""
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)


def _main(target: str, rank: int, port: int, out_dir: str, sizes: dict, kwargs: dict,
          backend: str) -> None:
    import torch
    import torch.distributed as dist

    from omnistage.layers.groups import close_stage_ranks, init_stage_ranks

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    ranks = init_stage_ranks(ParallelSizes(**sizes), rank, f"tcp://127.0.0.1:{port}", backend)
    try:
        module, _, name = target.partition(":")
        result = getattr(importlib.import_module(module), name)(ranks, **kwargs)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()   # rank 0 hosts the rendezvous store: nobody leaves while it is needed
    finally:
        close_stage_ranks()


if __name__ == "__main__":
    t, r, p, o, s, k, b = sys.argv[1:8]
    _main(t, int(r), int(p), o, json.loads(s), json.loads(k), b)
    # gloo's threads can abort in C++ static teardown: the result is written, leave at once
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
