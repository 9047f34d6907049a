"""Tensor-parallel layers on 2 CPU ranks (gloo) equal the whole layers: each rank loads whole
checkpoint tensors through the loaders and keeps its slice; row-parallel sums, the vocabulary
embedding and the LM head's gather cross ranks. Issue 18's groundwork."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.configs.schema import ParallelSizes
from omnistage.layers import parallel as tp
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


def test_one_rank_is_the_single_device_layer() -> None:
    torch.manual_seed(0)
    layer = tp.ColumnParallelLinear(8, 6, bias=True, gather_output=True)
    w, b = torch.randn(6, 8), torch.randn(6)
    layer.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, w, b))


def test_layouts_that_do_not_divide_are_refused() -> None:
    tp.set_tp_group(tp.TPGroup(0, 2, None))
    try:
        with pytest.raises(ValueError, match=r"attention heads \(3\) is not divisible by the "
                                             "tensor-parallel size 2"):
            tp.QKVParallelLinear(16, 4, 3, 1)
        with pytest.raises(ValueError, match=r"key/value heads \(3\) is not divisible"):
            tp.QKVParallelLinear(16, 4, 4, 3)
        # a vocabulary that does not divide is padded: rank 0 of 2 keeps 32 real rows of 63
        embed = tp.VocabParallelEmbedding(63, 8)
        assert (embed.local_rows, embed.num_real) == (32, 32)
    finally:
        tp.set_tp_group(None)


def test_replicated_layers_stay_whole_inside_a_split_model() -> None:
    """What rank 0 alone runs (a talker's code predictor) is built whole on every rank."""
    tp.set_tp_group(tp.TPGroup(1, 2, None))
    try:
        with tp.replicated():
            whole = tp.RowParallelLinear(8, 4, bias=True)
        split = tp.RowParallelLinear(8, 4, bias=True)
        assert whole.weight.shape == (4, 8) and whole.local_bias is whole.bias
        assert split.weight.shape == (4, 4) and split.local_bias is None   # rank 0 adds it
        assert tp.tp_group().rank == 1
    finally:
        tp.set_tp_group(None)
