"""GGUF block dequantization and GGUFLinear, golden per format against gguf.quants.dequantize."""

import numpy as np
import pytest
import torch

from omnistage.layers.gguf import FORMATS, GGUFLinear, dequantize
from tests.helpers.gguf_blocks import random_blocks

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("qtype", sorted(FORMATS), ids=[FORMATS[q][0] for q in sorted(FORMATS)])
def test_dequantize_matches_gguf(qtype):
    data = random_blocks(qtype, rows=3, in_features=512, seed=qtype)
    ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(qtype))     # (3, 512)
    ours = dequantize(torch.from_numpy(data), qtype)
    assert ours.shape == (3, 512)
    assert np.abs(ref).mean() > 1e-3
    torch.testing.assert_close(ours, torch.from_numpy(ref).float(), rtol=1e-6, atol=1e-7)


def test_linear_is_dequantize_then_matmul():
    data = torch.from_numpy(random_blocks(12, rows=5, in_features=256, seed=1))
    bias = torch.randn(5)
    layer = GGUFLinear(data, 12, 256, bias)
    x = torch.randn(2, 3, 256)
    w = torch.from_numpy(gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType.Q4_K))
    torch.testing.assert_close(layer(x), x @ w.float().T + bias, rtol=1e-5, atol=1e-5)


def test_bad_shapes_and_types_refused():
    with pytest.raises(ValueError, match="does not hold"):
        GGUFLinear(torch.zeros(4, 34, dtype=torch.uint8), 8, 64, None)
    with pytest.raises(ValueError, match="not supported"):
        dequantize(torch.zeros(4, 34, dtype=torch.uint8), 3)
