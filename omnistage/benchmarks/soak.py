"""A soak of the OpenAI server (issue 25; not in CI): the tiny random Qwen3 and the digits demo
served as they are in production (`omnistage serve`, stage processes, shm connector), driven
for --minutes by --workers threads with a mix of what users and attackers send:

    chat, whole and streamed to the end         completions
    streams dropped after their first chunk     images from the demo
    bad requests (broken JSON, NaN, 2**64, a lone surrogate, an unknown model)

Every 15 s it records the resident memory of each server's process tree (the API process and
its stage processes, from /proc) and the shared-memory segments in /dev/shm. At the end the
servers are stopped (SIGTERM) and it checks that no process of theirs and no segment is left.

    .venv/bin/python -m omnistage.benchmarks.soak --minutes 10 --out benchmarks/results/soak_cpu.json

Reported: requests by kind and status (a 5xx or a client timeout counts as a failure), and
the memory growth of each tree from the first sample after the warm-up minute to the last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from omnistage.testing.processes import free_port
from omnistage.testing.tiny_models import build_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]      # the checkout
BAD_BODIES = ['{"model": "m", "messages": [', '{"model": "m", "messages": [], "temperature": NaN}',
              '{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
              '"max_tokens": 18446744073709551616}',
              '{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
              '{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}']


def start(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "omnistage.entrypoints.cli.main", "serve", *args, "--port",
           str(port), "--device", "cpu", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("server not ready in 180 s")


def tree(pid: int) -> list[int]:
    """pid and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def rss_mib(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()}


def one_request(kind: str, text: str, image: str, client: httpx.Client) -> str:
    """Send one request of `kind`; -> its outcome ('200', '400', 'dropped', 'timeout', ...)."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "tell me a story"}],
            "max_tokens": 24}
    if kind == "chat":
        return str(client.post(f"{text}/v1/chat/completions", json=chat).status_code)
    if kind == "completion":
        return str(client.post(f"{text}/v1/completions", json={
            "model": "tiny", "prompt": "once upon a time", "max_tokens": 24}).status_code)
    if kind in ("stream", "dropped"):
        with client.stream("POST", f"{text}/v1/chat/completions",
                           json={**chat, "stream": True}) as r:
            for _ in r.iter_lines():
                if kind == "dropped":
                    return "dropped"       # the socket closes with the stream
            return str(r.status_code)
    if kind == "image":
        return str(client.post(f"{image}/v1/images/generations", json={
            "prompt": "a handwritten 3", "n": 2, "seed": random.randrange(1000)}).status_code)
    body = random.choice(BAD_BODIES)
    return str(client.post(f"{text}/v1/chat/completions", content=body,
                           headers={"Content-Type": "application/json"}).status_code)


def drive(text: str, image: str, until: float, counts: Counter, lock: threading.Lock) -> None:
    kinds = ["chat", "completion", "stream", "dropped", "image", "bad"]
    with httpx.Client(timeout=60) as client:
        while time.monotonic() < until:
            kind = random.choice(kinds)
            try:
                outcome = one_request(kind, text, image, client)
            except httpx.TimeoutException:
                outcome = "timeout"
            except httpx.HTTPError as exc:
                outcome = type(exc).__name__
            with lock:
                counts[f"{kind} {outcome}"] += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    random.seed(0)
    with tempfile.TemporaryDirectory(prefix="omnistage-soak-") as tmp:
        model = build_tiny_checkpoint(Path(tmp) / "tiny")
        shm_before = segments()
        text_proc, text = start([str(model), "--served-model-name", "tiny"], Path(tmp) / "t.log")
        image_proc, image = start([], Path(tmp) / "i.log")
        procs = {"text": text_proc, "image": image_proc}
        counts: Counter = Counter()
        lock = threading.Lock()
        t0 = time.monotonic()
        until = t0 + args.minutes * 60
        workers = [threading.Thread(target=drive, args=(text, image, until, counts, lock))
                   for _ in range(args.workers)]
        for w in workers:
            w.start()
        samples = []
        while time.monotonic() < until:
            samples.append({"t_s": round(time.monotonic() - t0, 1),
                            **{k: round(rss_mib(tree(p.pid)), 1) for k, p in procs.items()},
                            "shm_segments": len(segments() - shm_before)})
            print(samples[-1], flush=True)
            time.sleep(15)
        for w in workers:
            w.join(timeout=120)
        pids = {k: tree(p.pid) for k, p in procs.items()}
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.wait(timeout=60)
        time.sleep(2)
        left = [pid for group in pids.values() for pid in group if Path(f"/proc/{pid}").exists()]
        shm_left = sorted(segments() - shm_before)
    warm = [s for s in samples if s["t_s"] >= 60] or samples
    failures = {k: v for k, v in counts.items()
                if k.split()[1][0] == "5" or k.split()[1] in ("timeout",)}
    result = {"minutes": args.minutes, "workers": args.workers, "requests": sum(counts.values()),
              "by_kind_and_status": dict(sorted(counts.items())), "failures": failures,
              "rss_mib": {k: {"after_warmup": warm[0][k], "end": warm[-1][k],
                              "growth_pct": round(100 * (warm[-1][k] / warm[0][k] - 1), 2)}
                          for k in procs},
              "processes_left": left, "shm_segments_left": shm_left, "samples": samples}
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if failures or left or shm_left else 0


if __name__ == "__main__":
    sys.exit(main())
