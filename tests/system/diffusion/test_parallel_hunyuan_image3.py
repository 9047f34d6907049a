"""HunyuanImage-3.0 over two CPU ranks (gloo) through its diffusion stage against one rank: the
MoE transformer split by TP (whole kv heads and half of every expert per rank), rank 0 preparing
and the other following its step plans, each rank running the requests' prefixes in their first
step. Three requests batched (odd 28x36 grid, two images of one prompt, one with no size, which
takes the 1:1 base size over several ranks): the one-rank latents and images. Then through
`Omni` (one process per rank), and layouts the checkpoint cannot split refused before any
process starts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from omnistage.configs.schema import ParallelSizes
from omnistage.diffusion.params import DiffusionParams
from omnistage.layers.groups import StageRanks
from omnistage.testing.ranks import run_ranks
from tests.helpers.hunyuan_image3 import build_checkpoint, stage_run

STEPS = dict(num_inference_steps=2, guidance_scale=4.0, flow_shift=3.0)
CASES = [{"id": "wide", "prompt": "a red cat on a small house",
          "params": dict(height=28, width=36, seed=11, **STEPS)},
         {"id": "pair", "prompt": "a painting of a green tree over the river",
          "params": dict(height=32, width=32, seed=5, num_images=2, num_inference_steps=3,
                         guidance_scale=2.5, flow_shift=1.0)},
         {"id": "auto", "prompt": "a small house", "params": dict(seed=7, **STEPS)}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_checkpoint(tmp_path_factory.mktemp("hi3")))


@pytest.fixture(scope="module")
def reference(folder: str) -> dict:
    """The cases on one rank, in this process; "auto" at the base size it takes over ranks."""
    cases = [c if c["id"] != "auto" else {**c, "params": {**c["params"], "height": 32,
                                                          "width": 32}} for c in CASES]
    return stage_run(StageRanks.single(), folder, cases)


def test_stage_at_tp2_equals_tp1(folder: str, reference: dict, tmp_path: Path) -> None:
    results = run_ranks("tests.helpers.hunyuan_image3:stage_run", ParallelSizes(tp=2),
                        {"folder": folder, "cases": CASES}, tmp_path)
    assert results[1] == {}
    assert reference["pair"]["shape"] == [2, 32, 32, 3]
    assert reference["auto"]["shape"] == [1, 32, 32, 3]         # 1:1 over ranks
    for rid, ref in reference.items():
        got = results[0][rid]
        assert got["shape"] == ref["shape"], rid
        want = torch.tensor(ref["latents"])
        assert want.abs().mean() > 0.3, (rid, "latents too small to compare")
        diff = float((torch.tensor(got["latents"]) - want).abs().max())
        assert diff < 1e-4, (rid, diff)
        pixels = (torch.tensor(got["image"]) - torch.tensor(ref["image"])).abs().max()
        assert pixels <= 1, (rid, pixels)


def test_omni_serves_over_two_ranks(folder: str, reference: dict) -> None:
    """The shipped graph with tensor_parallel_size 2: a process per rank; the one-rank image."""
    from omnistage import Omni

    with Omni(folder, device="cpu", tensor_parallel_size=2) as omni:
        assert len(omni.engine.orchestrator.stages.rank_pids["dit"]) == 2
        (out,) = omni.generate(CASES[0]["prompt"], DiffusionParams(**CASES[0]["params"]))
    assert out.error is None and out.images[0].size == (36, 28)
    got = torch.from_numpy(np.asarray(out.images[0])).float().flatten()
    assert (got - torch.tensor(reference["wide"]["image"])).abs().max() <= 1


@pytest.mark.parametrize("sizes, message", [
    (dict(tensor_parallel_size=4), r"num_key_value_heads \(2\) is not divisible"),
    (dict(ulysses_degree=2), r"ulysses_degree=2: the 'hunyuan_image3' pipeline does not split"),
])
def test_layouts_it_cannot_split_are_refused(folder: str, sizes: dict, message: str) -> None:
    from omnistage import Omni

    with pytest.raises(ValueError, match=r"^stage 'dit': .*" + message):
        Omni(folder, device="cpu", **sizes)
