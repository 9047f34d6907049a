"""Tensor-parallel layers on 2 CPU ranks (gloo) equal the whole layers: each rank loads whole
checkpoint tensors through the loaders and keeps its slice; row-parallel sums, the vocabulary
embedding and the LM head's gather cross ranks. Issue 18's groundwork."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from omnistage.layers import parallel as tp

TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world_size: int, num_kv_heads: int, out_dir: Path) -> list[dict[str, float]]:
    """One process per rank, each `python -m omnistage.testing.parallel_check`; all end."""
    port = _free_port()
    procs = []
    for r in range(world_size):
        with open(out_dir / f"err{r}", "w") as err:   # the child keeps its own descriptor
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "omnistage.testing.parallel_check", str(r),
                 str(world_size), str(port), str(out_dir), str(num_kv_heads)],
                stdout=subprocess.DEVNULL, stderr=err))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    for r, p in enumerate(procs):
        assert p.returncode == 0, (r, (out_dir / f"err{r}").read_text()[-2000:])
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_two_ranks_equal_the_whole_layers(num_kv_heads: int, tmp_path: Path) -> None:
    for rank, errors in enumerate(_run(2, num_kv_heads, tmp_path)):
        assert set(errors) == {"q", "k", "v", "mlp", "o_proj", "embed", "lm_head"}
        for name, err in errors.items():
            assert err < 1e-5, (rank, name, err)     # float32 sums in another order


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
