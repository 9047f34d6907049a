"""A stage process's intra-op threads: one for a GPU stage (its host work is bookkeeping, and
every process spinning a pool on all cores slowed each other's small copies tenfold); a CPU
stage's share of the cores (unless the user set OMP_NUM_THREADS: `_process_main`)."""

from __future__ import annotations

import os

from omnistage.configs.graph import load_graph
from omnistage.stages.process import stage_cpu_threads

GRAPH = """
model: /models/m
stages:
  - {name: a, kind: ar, final: text}
  - name: b
    kind: ar
    final: tensor
    inputs: [{from: a, adapter: hidden_to_embeds, chunked: true}]
"""


def test_gpu_stage_gets_one_thread() -> None:
    graph = load_graph(GRAPH)
    assert stage_cpu_threads(graph, "cuda:0") == stage_cpu_threads(graph, "cuda:1") == 1


def test_cpu_stages_share_the_cores() -> None:
    cores = len(os.sched_getaffinity(0))
    assert stage_cpu_threads(load_graph(GRAPH), "cpu") == max(1, cores // 2)
