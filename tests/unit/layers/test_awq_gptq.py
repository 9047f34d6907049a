"""AutoAWQ GEMM and GPTQ tensors (layers/awq_gptq.py) against the layouts' own projects
(tests/fixtures/awq_gptq_pack, written by scripts/awq_gptq_pack_fixtures.py with AutoAWQ's
`WQLinear_GEMM.from_linear` / `dequantize_gemm` and AutoGPTQ's `QuantLinear.pack` and CPU
forward): the words they packed load into a PackedInt4Linear whose weight is theirs, and the
test helper's packing (tests/helpers/awq_gptq_checkpoint.py, used by the golden tests) writes
their words bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from omnistage.layers.awq_gptq import PackedInt4Linear, PackedLayout
from omnistage.layers.int4 import Int4Linear, pack_int4
from omnistage.layers.linear import Linear
from tests.helpers.awq_gptq_checkpoint import (AWQ_PACK_ORDER, pack_along_columns,
                                               pack_along_rows)

FIXTURES = Path(__file__).parents[2] / "fixtures" / "awq_gptq_pack"
LAYOUTS = {"awq_gemm": PackedLayout("awq", 32),
           "gptq_v1": PackedLayout("gptq", 32, zero_offset=1),
           "gptq_v1_act_order_sym": PackedLayout("gptq", 32, zero_offset=1, symmetric=True,
                                                 act_order=True)}


def fixture(name: str) -> dict[str, torch.Tensor]:
    path = FIXTURES / f"{name}.safetensors"
    with safe_open(path, "pt") as f:
        assert f.metadata()["group_size"] == "32"
    return load_file(path)


def loaded(name: str, dtype: torch.dtype) -> PackedInt4Linear:
    t = fixture(name)
    n, k = t["q"].shape
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = PackedInt4Linear(Linear(k, n), LAYOUTS[name])
    finally:
        torch.set_default_dtype(prev)
    for param_name, param in layer.named_parameters():
        param.weight_loader(param, t[param_name])
    return layer


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_their_words_load_as_their_weight(name: str) -> None:
    t = fixture(name)
    layer = loaded(name, torch.float32)
    g = torch.arange(t["q"].shape[1]) // 32 if "g_idx" not in t else t["g_idx"].long()
    exact = (t["q"].long() - t["z"].long()[:, g]).float() * t["s"].float()[:, g]
    w = layer.dequantized(torch.float32)
    assert torch.equal(w, exact)
    if t["dequantized"].dtype == torch.float32:                    # AutoGPTQ's CPU forward
        assert torch.equal(w, t["dequantized"].T)
    x = torch.randn(3, w.shape[1])
    torch.testing.assert_close(layer(x), x @ exact.T, rtol=1e-5, atol=1e-5)


def test_awq_in_float16_equals_autoawq_dequantize() -> None:
    """AutoAWQ's `dequantize_gemm` rounds (q - z) * s to fp16; so does the layer in fp16."""
    layer = loaded("awq_gemm", torch.float16)
    assert torch.equal(layer.dequantized(torch.float16), fixture("awq_gemm")["dequantized"].T)


def test_symmetric_gptq_keeps_no_zero_points() -> None:
    layer = loaded("gptq_v1_act_order_sym", torch.float32)
    _, _, zero, g_idx = layer.parts()
    assert zero is None and g_idx is not None
    bad = fixture("gptq_v1_act_order_sym")["qzeros"] ^ 1                # a zero of 7 or 9
    with pytest.raises(ValueError, match="sym true but zero points other than 8"):
        layer.qzeros.weight_loader(layer.qzeros, bad)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_helper_packs_as_the_projects_do(name: str) -> None:
    t = fixture(name)
    stored_z = t["z"].long() - (0 if name.startswith("awq") else 1)        # v1: z - 1
    if name.startswith("awq"):
        assert torch.equal(pack_along_columns(t["q"].long().T, AWQ_PACK_ORDER), t["qweight"])
        assert torch.equal(pack_along_columns(stored_z.T, AWQ_PACK_ORDER), t["qzeros"])
    else:
        assert torch.equal(pack_along_rows(t["q"].long().T), t["qweight"])
        assert torch.equal(pack_along_columns(stored_z.T, tuple(range(8))), t["qzeros"])


def test_int4_linear_with_zero_points_and_g_idx() -> None:
    """Int4Linear built directly from unsigned nibbles, zero points and g_idx (the buffers a
    converted checkpoint could hand it) computes AutoGPTQ's weight; wrong shapes are refused."""
    t = fixture("gptq_v1")
    n, k = t["q"].shape
    g_idx = t["g_idx"][torch.randperm(k, generator=torch.Generator().manual_seed(0))]
    layer = Int4Linear(pack_int4(t["q"].long() - 8), t["s"].float(), k, 32,
                       weight_zero=t["z"], g_idx=g_idx)
    g = g_idx.long()
    exact = (t["q"].long() - t["z"].long()[:, g]).float() * t["s"].float()[:, g]
    assert torch.equal(layer.dequantized(torch.float32), exact)
    with pytest.raises(ValueError, match="weight_zero: the scales' shape"):
        Int4Linear(pack_int4(t["q"].long() - 8), t["s"].float(), k, 32, weight_zero=t["z"][:1])
    with pytest.raises(ValueError, match=r"g_idx: \(128,\) expected"):
        Int4Linear(pack_int4(t["q"].long() - 8), t["s"].float(), k, 32, g_idx=g_idx[:8])
