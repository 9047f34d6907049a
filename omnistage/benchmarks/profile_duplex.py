"""What one duplex tick (stages/moshi_duplex.py `MoshiDuplex.tick`) launches, per number of
sessions: torch.profiler's leaf operators (on the CPU, each one a kernel launch on CUDA run
eagerly), split into the codec and glue around the engine, the temporal step and the depth
transformer (the feedback hook); on CUDA also the kernels, graph launches and device-to-host
copies the profiler saw, and the tick's wall time; and every host read (`.cpu()`, `.item()`,
`.tolist()`) the tick made, by file. With --graphs on on the CPU the captures are emulated
(a replay reruns the function), and `launches_with_graphs` counts each replay as the one
launch it is on CUDA instead of the operators inside it.

    python -m omnistage.benchmarks.profile_duplex --shape mid --device cpu --sessions 1,4,8
    python -m omnistage.benchmarks.profile_duplex --shape mid --graphs on   # emulated graphs
    python -m omnistage.benchmarks.profile_duplex --shape 7b --device cuda --sessions 1,8,16 \\
        --ticks 20 --out $OUT/profile_duplex.json          # the GPU: graphs on by default

shape: tiny (the duplex tests' Moshi), mid (the 7B's structure, every layer and codebook of
it, at small widths: launch counts as the 7B's, cheap on a CPU), 7b (benchmarks/duplex.py's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

# views and metadata: no kernel on any device
_NO_KERNEL = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::slice",
    "aten::select", "aten::transpose", "aten::t", "aten::permute", "aten::unsqueeze",
    "aten::squeeze", "aten::expand", "aten::expand_as", "aten::detach", "aten::alias",
    "aten::split", "aten::chunk", "aten::unbind", "aten::narrow", "aten::empty",
    "aten::empty_strided", "aten::empty_like", "aten::lift_fresh", "aten::flatten",
    "aten::unflatten", "aten::contiguous", "aten::resolve_conj", "aten::resolve_neg",
    "aten::result_type", "aten::is_nonzero", "aten::view_as", "aten::_unsafe_view",
    "aten::split_with_sizes", "aten::to", "aten::type_as", "aten::dropout",
}


def mid_config() -> dict[str, Any]:
    """The 7B's layers, codebooks and codec structure at small widths."""
    from omnistage.benchmarks.duplex import MOSHI_7B

    mimi = dict(MOSHI_7B["audio_encoder_config"], hidden_size=64, num_filters=8,
                num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                codebook_dim=32, vector_quantization_hidden_dimension=32, upsample_groups=64)
    depth = dict(MOSHI_7B["depth_decoder_config"], hidden_size=64, num_attention_heads=4,
                 num_key_value_heads=4, ffn_dim=128)
    return dict(MOSHI_7B, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                head_dim=16, ffn_dim=128, num_hidden_layers=4, depth_decoder_config=depth,
                audio_encoder_config=mimi)


def build(shape: str, path: Path, device: torch.device, dtype: torch.dtype) -> Path:
    from omnistage.benchmarks.duplex import build_checkpoint

    if shape != "mid":
        return build_checkpoint(shape, path, device, dtype, 0)
    from transformers import MoshiConfig, MoshiForConditionalGeneration

    torch.manual_seed(0)
    MoshiForConditionalGeneration(MoshiConfig(**mid_config())).eval().save_pretrained(path)
    return path


class HostReads:
    """Counts `.cpu()`, `.item()` and `.tolist()` by the file that called them."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._saved: dict[str, Callable] = {}

    def __enter__(self) -> HostReads:
        for name in ("cpu", "item", "tolist"):
            original = self._saved[name] = getattr(torch.Tensor, name)

            def wrapped(t: torch.Tensor, *a: Any, _name=name, _f=original, **kw: Any) -> Any:
                caller = sys._getframe(1).f_code.co_filename.split("omnistage/")[-1]
                self.counts[f"{_name} {caller}"] += 1
                return _f(t, *a, **kw)
            setattr(torch.Tensor, name, wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


def _label(obj: object, attr: str, label: str) -> None:
    fn = getattr(obj, attr)

    def labelled(*a: Any, **kw: Any) -> Any:
        with record_function(label):
            return fn(*a, **kw)
    setattr(obj, attr, labelled)


def count_ops(prof: profile, ticks: int) -> dict[str, float]:
    """Leaf operators a tick, by the label they ran under."""
    by: Counter[str] = Counter()
    for ev in prof.events():
        if not ev.name.startswith("aten::") or ev.name in _NO_KERNEL:
            continue
        if any(c.name.startswith("aten::") for c in ev.cpu_children):
            continue                                          # not a leaf: its children count
        where, parent, replayed = "codec_and_glue", ev.cpu_parent, False
        while parent is not None:
            replayed = replayed or parent.name == "graph_replay"
            if parent.name in ("feedback", "engine_step"):
                where = "depth_feedback" if parent.name == "feedback" else "engine_temporal"
                break
            parent = parent.cpu_parent
        by[where + (" (in graphs)" if replayed else "")] += 1
    out = {k: v / ticks for k, v in sorted(by.items())}
    out["total"] = sum(by.values()) / ticks
    replays = sum(1 for ev in prof.events() if ev.name == "graph_replay")
    if replays:     # emulated graphs: on CUDA each replay is one launch instead of its ops
        out["graph_replays"] = replays / ticks
        out["launches_with_graphs"] = (out["total"] + out["graph_replays"] - sum(
            v for k, v in by.items() if k.endswith("(in graphs)")) / ticks)
    return out


def emulate_graphs() -> None:
    """CPU: captures rerun on replay (testing/graph_emulation.py), each replay labelled."""
    from omnistage.layers import graph_capture
    from omnistage.testing.graph_emulation import RerunGraph, rerun_capture

    class Labelled(RerunGraph):
        def replay(self) -> None:
            with record_function("graph_replay"):
                super().replay()

    def capture(fn: Callable[[], object], pool: object) -> tuple[RerunGraph, object]:
        graph, out = rerun_capture(fn, pool)
        return Labelled(graph.fn, out), out
    graph_capture.capture_graph = capture


def cuda_counts(prof: profile, ticks: int) -> dict[str, float]:
    kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    names = Counter(e.name for e in prof.events() if e.device_type.name == "CPU")
    return {"cuda_kernels": kernels / ticks,
            "graph_launches": names["cudaGraphLaunch"] / ticks,
            "memcpy_calls": (names["cudaMemcpyAsync"] + names["cudaMemcpy"]) / ticks,
            "syncs": (names["cudaStreamSynchronize"] + names["cudaDeviceSynchronize"]) / ticks}


def profile_sessions(duplex: Any, n: int, ticks: int, warmup: int) -> dict[str, Any]:
    device = duplex.device
    frame = lambda i: 0.3 * torch.randn(duplex.frame_size)     # noqa: E731
    sids = [f"s{n}-{i}" for i in range(n)]
    for sid in sids:
        duplex.open(sid)
    for _ in range(warmup):
        duplex.tick({sid: frame(i) for i, sid in enumerate(sids)})
    walls = []
    for _ in range(ticks):
        t0 = time.perf_counter()
        duplex.tick({sid: frame(i) for i, sid in enumerate(sids)})
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        walls.append((time.perf_counter() - t0) * 1e3)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with HostReads() as reads, profile(activities=activities) as prof:
        for _ in range(ticks):
            duplex.tick({sid: frame(i) for i, sid in enumerate(sids)})
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for sid in sids:
        duplex.close(sid)
    row: dict[str, Any] = {"sessions": n, "ops_per_tick": count_ops(prof, ticks),
                           "host_reads_per_tick": {k: v / ticks for k, v in reads.counts.items()},
                           "tick_ms": {"mean": statistics.mean(walls),
                                       "p50": statistics.median(walls), "max": max(walls)}}
    if device.type == "cuda":
        row["cuda_per_tick"] = cuda_counts(prof, ticks)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=("tiny", "mid", "7b"), default="mid")
    p.add_argument("--device", default="cpu")
    p.add_argument("--sessions", default="1,4,8")
    p.add_argument("--ticks", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--graphs", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    from omnistage.stages.moshi_duplex import MoshiDuplex

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sessions = [int(s) for s in args.sessions.split(",")]
    kwargs = {} if args.graphs == "auto" else {"use_graphs": args.graphs == "on"}
    if args.graphs == "on" and device.type == "cpu":
        emulate_graphs()
    with tempfile.TemporaryDirectory(prefix="omnistage-profile-duplex-") as tmp:
        path = build(args.shape, Path(tmp) / "moshi", device, dtype)
        duplex = MoshiDuplex(path, device=str(device), dtype=str(dtype).split(".")[-1],
                             max_sessions=max(sessions), **kwargs)
    _label(duplex.engine, "step", "engine_step")
    _label(duplex.model, "feedback", "feedback")
    result = {"shape": args.shape, "device": str(device), "graphs": args.graphs,
              "rows": [profile_sessions(duplex, n, args.ticks, args.warmup) for n in sessions]}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return result


if __name__ == "__main__":
    main()
