"""CUDA-graph capture helpers shared by the decode graphs (ar/cuda_graphs.py) and the models
that replay their own (the Qwen3-Omni code predictor): one capture, the batch-size buckets.
Tests on CPU replace `capture_graph` with a stand-in whose replay reruns the function."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


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
