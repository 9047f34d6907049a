"""Checked before any stage starts: every stage's GPU exists, and AR stages that share a GPU
leave room for each other (their memory_fraction, each a share of the whole device, add up to
at most 1). The tests pretend the machine has two GPUs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omnistage.configs.defaults import stage_config_text
from omnistage.configs.graph import load_graph
from omnistage.configs.schema import ParallelSizes
from omnistage.stages.process import check_gpu_placement, stage_device

GRAPH = """
model: /models/m
stages:
  - {{name: a, kind: ar, final: text, placement: {{memory_fraction: {a}}}}}
  - name: b
    kind: ar
    placement:
      memory_fraction: {b}
      devices: [{device_b}]
    final: tensor
    inputs: [{{from: a, adapter: hidden_to_embeds, chunked: true}}]
"""


def graph(a: float, b: float, device_b: int = 0):
    return load_graph(GRAPH.format(a=a, b=b, device_b=device_b))


@pytest.fixture(autouse=True)
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.parametrize("num_gpus, device, message", [
    (2, "cuda", r"stage 'b' is placed on cuda:2, but this machine has 2 GPUs"),
    (0, "cuda", r"stage 'a' is placed on cuda:0, but this machine has 0 GPUs: run on the CPU"),
    (1, "cuda:1", r"stage 'a' is placed on cuda:1, but this machine has 1 GPU:"),
])
def test_a_stage_on_a_missing_gpu_is_refused(num_gpus: int, device: str, message: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)
    with pytest.raises(ValueError, match=message):
        check_gpu_placement(graph(0.5, 0.4, device_b=2), device)


def test_shared_gpu_fractions_over_one_are_refused() -> None:
    with pytest.raises(ValueError, match=r"stages a 0\.9, b 0\.9 share cuda:0: .* 1\.8"):
        check_gpu_placement(graph(0.9, 0.9), "cuda")


def test_each_replica_counts_on_its_gpu() -> None:
    """Two replicas of b on b's GPU take its fraction twice; a list per replica spreads them."""
    two = graph(0.3, 0.4)
    b = replace(two.stages[1], placement=replace(two.stages[1].placement, replicas=2))
    with pytest.raises(ValueError, match=r"stages a 0\.3, b#0 0\.4, b#1 0\.4 share cuda:0"):
        check_gpu_placement(replace(two, stages=(two.stages[0], b)), "cuda")
    spread = replace(b, placement=replace(b.placement, replica_devices=[[0], [1]]))
    check_gpu_placement(replace(two, stages=(two.stages[0], spread)), "cuda")
    with pytest.raises(ValueError, match=r"stage 'b' is placed on cuda:2"):
        spread = replace(b, placement=replace(b.placement, replica_devices=[[0], [2]]))
        check_gpu_placement(replace(two, stages=(two.stages[0], spread)), "cuda")


@pytest.mark.parametrize("a, b, device_b, device", [
    (0.75, 0.12, 0, "cuda"),       # the Qwen3-Omni split
    (0.9, 0.9, 1, "cuda"),         # each on its own GPU
    (0.9, 0.9, 0, "cpu"),          # CPU stages size their cache in bytes, not fractions
])
def test_budgets_that_fit_are_accepted(a: float, b: float, device_b: int, device: str) -> None:
    check_gpu_placement(graph(a, b, device_b), device)


def test_packaged_two_gpu_qwen3_omni_graph() -> None:
    """qwen3_omni_2gpu: the default Qwen3-Omni graph with the thinker alone on GPU 0 and the
    talker and code2wav on GPU 1; everything else as the default graph."""
    two = load_graph(stage_config_text("qwen3_omni_2gpu"))
    one = load_graph(stage_config_text("qwen3_omni"))
    check_gpu_placement(two, "cuda")
    check_gpu_placement(one, "cuda")
    assert {s.name: stage_device("cuda", s.placement.devices) for s in two.stages} == {
        "thinker": "cuda:0", "talker": "cuda:1", "code2wav": "cuda:1"}
    for a, b in zip(two.stages, one.stages):
        assert replace(a, placement=b.placement) == b, a.name


PARALLEL = """
model: /models/m
backend: {backend}
stages:
  - {{name: a, kind: {kind}, final: {final}, placement: {{devices: {devices}}},
     parallel: {{{sizes}}}}}
"""


def parallel_graph(sizes: str, kind: str = "ar", devices: str = "[0, 1]",
                   backend: str = "process"):
    final = {"ar": "text", "diffusion": "image", "generation": "audio"}[kind]
    return load_graph(PARALLEL.format(kind=kind, final=final, devices=devices, sizes=sizes,
                                      backend=backend))


@pytest.mark.parametrize("sizes, kind, devices, backend, message", [
    ("ulysses: 2", "ar", "[0, 1]", "process",
     r"stage 'a': a ar stage cannot split by ulysses_degree \(it supports: tensor_parallel_size\)"),
    ("tp: 2", "generation", "[0, 1]", "process",
     r"a generation stage cannot split by tensor_parallel_size \(it supports: none\)"),
    ("tp: 2", "ar", "[0]", "process",
     r"stage 'a' has 2 ranks \(tensor_parallel_size 2\) but lists 1 device\(s\) \[0\]"),
    ("cfg: 2, ulysses: 2", "diffusion", "[0, 1, 2]", "process",
     r"has 4 ranks \(ulysses_degree 2 x cfg_parallel_size 2\) but lists 3 device"),
    ("tp: 2", "ar", "[0, 1]", "inproc", r"needs processes"),
    ("tp: 2", "ar", "[1, 2]", "process",
     r"stage 'a' is placed on cuda:2, but this machine has 2 GPUs"),
])
def test_impossible_parallel_layouts_are_refused_before_start(
        sizes: str, kind: str, devices: str, backend: str, message: str) -> None:
    g = parallel_graph(sizes, kind, devices, backend)
    with pytest.raises(ValueError, match=message):
        check_gpu_placement(g, "cuda")


def test_each_rank_counts_on_its_own_gpu() -> None:
    """Stage a's 2 ranks on GPUs 0 and 1, stage b on GPU 1: their fractions meet on GPU 1."""
    g = load_graph(GRAPH.format(a=0.5, b=0.6, device_b=1))
    a = replace(g.stages[0], parallel=ParallelSizes(tp=2),
                placement=replace(g.stages[0].placement, devices=(0, 1)))
    with pytest.raises(ValueError, match=r"stages a 0.5, b 0.6 share cuda:1"):
        check_gpu_placement(replace(g, stages=(a, g.stages[1])), "cuda")
    check_gpu_placement(g, "cuda")       # one rank each: a alone on GPU 0
    # on the CPU every rank is the CPU: no device count
    check_gpu_placement(parallel_graph("tp: 2", devices="[0]"), "cpu")
