"""Tensor-parallel layers on 2 CPU ranks (gloo) equal the whole layers: each rank loads whole
checkpoint tensors through the loaders and keeps its slice; row-parallel sums, the vocabulary
embedding and the LM head's gather cross ranks. Issue 18's groundwork."""

from __future__ import annotations


import pytest
import torch

from omnistage.layers import parallel as tp


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
