"""Tensor-parallel layers on 2 CPU ranks (gloo) equal the whole layers: each rank loads whole
checkpoint tensors through the loaders and keeps its slice; row-parallel sums, the vocabulary
embedding and the LM head's gather cross ranks. Issue 18's groundwork."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.configs.schema import ParallelSizes
from omnistage.testing.ranks import run_ranks


def _run(world_size: int, num_kv_heads: int, out_dir: Path) -> list[dict[str, float]]:
    """One process per rank (omnistage.testing.ranks), each checking the layers."""
    return run_ranks("omnistage.testing.parallel_check:rank_checks",
                     ParallelSizes(tp=world_size), {"num_kv_heads": num_kv_heads}, out_dir)


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_two_ranks_equal_the_whole_layers(num_kv_heads: int, tmp_path: Path) -> None:
    for rank, errors in enumerate(_run(2, num_kv_heads, tmp_path)):
        assert set(errors) == {"q", "k", "v", "mlp", "o_proj", "embed", "lm_head", "fp8_row",
                               "fp8_column"}
        for name, err in errors.items():
            # float32 sums in another order; FP8 shards: e4m3's rounding (a wrong shard's
            # scale, bias counted twice or a missing gather is far above)
            assert err < (0.08 if name.startswith("fp8") else 1e-5), (rank, name, err)

