"""CUDA-graph capture helpers shared by the decode graphs (ar/cuda_graphs.py) and the models
that replay their own (the Qwen3-Omni code predictor): one capture, the batch-size buckets,
graphs per call signature (`ShapeGraphs`) and the padded shapes of batched windows
(`PaddedShapes`). Tests on CPU replace `capture_graph` with a stand-in whose replay reruns the
function."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

import torch

T = TypeVar("T")
G = TypeVar("G")
logger = logging.getLogger(__name__)


def capture_graph(fn: Callable[[], T], pool: tuple[int, int] | None
                  ) -> tuple[torch.cuda.CUDAGraph, T]:
    """fn's kernels recorded as a CUDA graph in memory pool `pool` (None: a new one, read back
    with graph.pool()), after one warm-up run outside it (kernels built, workspaces allocated).
    The tensors fn returned belong to the graph: every replay rewrites them. thread_local:
    stages of the inproc backend launch work from other threads while a graph is captured
    mid-run; only this thread's calls are checked. (CPU tests replace this function with a
    stand-in whose replay reruns fn.)"""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, 8, then every 16 up to max_num_seqs (which is always one)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class ShapeGraphs:
    """`fn` replayed from CUDA graphs, one per call signature: every tensor argument's shape,
    dtype and device, and the value of every other argument (lists frozen to tuples). For a
    diffusion transformer's forward, whose Python and launches (thousands a step) cost more
    host time than a GPU of half the work spends on it: what keeps a parallel rank fed.

    A signature is captured the `capture_after`-th time it is called (the calls before run
    eagerly: one-off shapes cost no graph memory), up to `max_graphs` of them, all in one
    memory pool (they never run at once; each keeps only its inputs and output). Then a call
    copies its tensors into the graph's inputs, replays it and returns a copy of its output.
    fn must read nothing but its arguments' device memory and the parameters (no host sync,
    no host-to-device copy). Ranks of one stage call it with the same signatures in the same
    order, so their captures, and the collectives inside them, stay paired."""

    def __init__(self, fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
                 max_graphs: int = 8,
                 capture_after: int = 2) -> None:
        self.fn, self.max_graphs, self.capture_after = fn, max_graphs, capture_after
        self.seen: dict[tuple, int] = {}
        self.graphs: dict[tuple, tuple[object, list[torch.Tensor], torch.Tensor]] = {}
        self.pool: tuple[int, int] | None = None
        self.num_replays = 0

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        key, tensors = _signature(args, kwargs)
        entry = self.graphs.get(key)
        if entry is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] < self.capture_after or len(self.graphs) >= self.max_graphs:
                return self.fn(*args, **kwargs)
            entry = self.graphs[key] = self._capture(args, kwargs, tensors)
        graph, inputs, out = entry
        for buf, x in zip(inputs, tensors):
            buf.copy_(x)
        graph.replay()                                               # type: ignore[attr-defined]
        self.num_replays += 1
        return tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()

    def _capture(self, args: tuple, kwargs: dict, tensors: list[torch.Tensor]
                 ) -> tuple[object, list[torch.Tensor], torch.Tensor]:
        inputs = [t.clone() for t in tensors]
        slot = iter(inputs)

        def swap(v: object) -> object:
            return next(slot) if isinstance(v, torch.Tensor) else v

        static_args = [swap(a) for a in args]
        static_kwargs = {k: swap(v) for k, v in kwargs.items()}
        graph, out = capture_graph(lambda: self.fn(*static_args, **static_kwargs), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, inputs, out


def _signature(args: tuple, kwargs: dict) -> tuple[tuple, list[torch.Tensor]]:
    """-> (hashable key, the tensor arguments in order). Tensors count by shape, dtype and
    device; None and hashable values by value (lists and tuples frozen)."""
    key: list[object] = []
    tensors: list[torch.Tensor] = []
    for name, v in [*enumerate(args), *kwargs.items()]:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            key.append((name, tuple(v.shape), v.dtype, v.device))
        else:
            key.append((name, _freeze(v)))
    return tuple(key), tensors


def _freeze(v: object) -> object:
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, torch.Tensor):
        raise TypeError("ShapeGraphs: tensors inside lists are not graph inputs; pass each "
                        "tensor as an argument of its own")
    hash(v)
    return v


@dataclass(frozen=True, slots=True)
class PaddedShapes:
    """The few (rows, length) shapes a batched forward of windows is padded to, so that each
    can be captured once, at start-up, and replayed (`ShapeGraphs`): `lengths` the window
    lengths a stream plans (a longer window runs at its own length), rows 1, 2, 4, ... below
    the most that fit `max_frames` (rows x length; at least 1, at most `max_rows`), then that
    most."""
    lengths: tuple[int, ...]
    max_frames: int
    max_rows: int | None = None

    def row_sizes(self, length: int) -> list[int]:
        most = max(1, self.max_frames // length)
        if self.max_rows is not None:
            most = min(most, self.max_rows)
        return [1 << i for i in range(most.bit_length()) if 1 << i < most] + [most]

    def length(self, longest: int) -> int:
        """The planned length a window of `longest` frames is padded to (itself if none)."""
        return next((n for n in self.lengths if n >= longest), longest)

    def rows(self, num: int, length: int) -> int:
        """The rows a forward of `num` windows of `length` frames runs at (`num` past the
        most)."""
        return next((b for b in self.row_sizes(length) if b >= num), num)

    def all(self) -> list[tuple[int, int]]:
        """Every planned (rows, length), to capture them all at start-up."""
        return [(b, n) for n in self.lengths for b in self.row_sizes(n)]


def stack_padded(tensors: list[torch.Tensor], rows: int, length: int) -> torch.Tensor:
    """(rows, length, ...) zeros with tensors[i] (n_i, ...) in row i's first n_i entries."""
    out = tensors[0].new_zeros(rows, length, *tensors[0].shape[1:])
    for i, t in enumerate(tensors):
        out[i, :t.shape[0]] = t
    return out


class RowGraphs:
    """`fn(*rows)` replayed from CUDA graphs, one per batch-size bucket (`graph_batch_sizes`):
    every argument a tensor whose first dimension is the batch, the output one such tensor.
    A call of B rows copies them into the first B rows of static buffers, replays the smallest
    bucket of at least B and returns a copy of the first B rows of the output; padding rows
    keep whatever they held (their output is dropped), so fn must compute each row from that
    row alone (no reduction over the batch) and read nothing else but parameters. For a
    model's per-frame head (Moshi's depth transformer, Voxtral-TTS's flow head): tens of small
    kernels a row-batch, which eagerly cost more host time than the GPU spends on them."""

    def __init__(self, fn: Callable[..., torch.Tensor], examples: tuple[torch.Tensor, ...],
                 max_batch: int) -> None:
        self.fn = fn
        self.sizes = graph_batch_sizes(max_batch)
        n = self.sizes[-1]
        self.inputs = [torch.zeros(n, *x.shape[1:], dtype=x.dtype, device=x.device)
                       for x in examples]
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self.pool: tuple[int, int] | None = None
        self.num_replays = 0

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every bucket, largest first (its pool then holds the smaller ones)."""
        for bs in reversed(self.sizes):
            graph, out = capture_graph(lambda bs=bs: self.fn(*(x[:bs] for x in self.inputs)),
                                       self.pool)
            if self.pool is None:
                self.pool = graph.pool()                              # type: ignore[attr-defined]
            self.graphs[bs] = (graph, out)

    def __call__(self, *rows: torch.Tensor) -> torch.Tensor:
        b = rows[0].shape[0]
        bs = next(s for s in self.sizes if s >= b)
        for buf, x in zip(self.inputs, rows, strict=True):
            buf[:b].copy_(x)
        graph, out = self.graphs[bs]
        graph.replay()                                                # type: ignore[attr-defined]
        self.num_replays += 1
        return out[:b].clone()


def checked(graphs: G, capture: Callable[[], None],
            runs: Iterable[tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]],
            what: str) -> G | None:
    """`graphs` once `capture` has run and every (eager, replayed) pair of `runs` gave equal
    tensors; otherwise (a capture that fails here, or a replay that differs) None, with a
    warning that `what` runs eagerly: the start-up check of a model's own graphs."""
    try:
        capture()
        for eager, replayed in runs:
            want, got = eager(), replayed()
            if not torch.equal(want, got):
                raise RuntimeError(f"replay differs: {want.tolist()} vs {got.tolist()}")
    except Exception as exc:   # capture not possible here: keep the eager path
        logger.warning("%s runs without CUDA graphs: %s", what, exc)
        return None
    return graphs
