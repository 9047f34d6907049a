"""AR stages that share a GPU must leave room for each other: their memory_fraction (each a
share of the whole device) add up to at most 1, checked before any stage starts."""

from __future__ import annotations

import pytest

from omnistage.configs.graph import load_graph
from omnistage.stages.process import check_gpu_budgets

GRAPH = """
model: /models/m
stages:
  - {{name: a, kind: ar, final: text, memory_fraction: {a}}}
  - name: b
    kind: ar
    memory_fraction: {b}
    final: tensor
    devices: [{device_b}]
    inputs: [{{from: a, adapter: hidden_to_embeds, chunked: true}}]
"""


def graph(a: float, b: float, device_b: int = 0):
    return load_graph(GRAPH.format(a=a, b=b, device_b=device_b))


def test_shared_gpu_fractions_over_one_are_refused() -> None:
    with pytest.raises(ValueError, match=r"stages a 0\.9, b 0\.9 share cuda:0: .* 1\.8"):
        check_gpu_budgets(graph(0.9, 0.9), "cuda")


@pytest.mark.parametrize("a, b, device_b, device", [
    (0.75, 0.12, 0, "cuda"),       # the Qwen3-Omni split
    (0.9, 0.9, 1, "cuda"),         # each on its own GPU
    (0.9, 0.9, 0, "cpu"),          # CPU stages size their cache in bytes, not fractions
])
def test_budgets_that_fit_are_accepted(a: float, b: float, device_b: int, device: str) -> None:
    check_gpu_budgets(graph(a, b, device_b), device)
