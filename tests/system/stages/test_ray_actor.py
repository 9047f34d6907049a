"""The Ray launcher without Ray: backend ray says how to get it (the process backend needs none;
tests/system/engine/test_ray.py runs stages on a cluster)."""

from __future__ import annotations

import sys

import pytest


def test_backend_ray_without_ray_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from omnistage.stages.ray_actor import require_ray

    monkeypatch.setitem(sys.modules, "ray", None)      # import ray: ImportError
    with pytest.raises(ImportError, match=r"omnistage\[ray\].*backend: process"):
        require_ray()


@pytest.mark.parametrize("ray_gpus, share", [(None, 1.0), (0.3, 1.0), (0.5, 1.0), (0.75, 0.75)])
def test_ranks_of_one_stage_never_share_a_gpu(ray_gpus: float | None, share: float) -> None:
    """A tensor-parallel stage's ranks take whole GPUs unless its stated share is above one
    half: two of its bundles then cannot meet on one GPU, and the rest of each GPU is free."""
    from omnistage.configs.schema import ParallelSizes, Placement, StageConfig
    from omnistage.stages.ray_actor import multi_rank_share

    stage = StageConfig(name="thinker", kind="ar", parallel=ParallelSizes(tp=2),
                        placement=Placement(devices=(0, 1), ray_gpus=ray_gpus))
    assert multi_rank_share(stage) == share
