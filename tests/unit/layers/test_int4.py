"""The W4A16 pack-quantized linear (layers/int4.py) against compressed-tensors' own packing and
dequantization (the layout's reference; tests/fixtures/int4_pack, written by
scripts/int4_pack_fixtures.py): the same int4 values out of the packed words, the same
dequantized weight bit for bit, and the linear equals a float matmul with that weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from omnistage.layers.int4 import (Int4Linear, dequantize_int4, pack_int4, quantize_int4,
                                  unpack_int4)

FIXTURE = Path(__file__).parents[2] / "fixtures" / "int4_pack" / "pack_quantized.safetensors"


@pytest.fixture(scope="module")
def ref() -> dict:
    with safe_open(FIXTURE, "pt") as f:
        group = int(f.metadata()["group_size"])
    return {**load_file(FIXTURE), "group": group}


def test_unpack_and_dequantize_as_the_reference(ref: dict) -> None:
    n, k = ref["weight_shape"].tolist()
    assert torch.equal(unpack_int4(ref["weight_packed"], k), ref["q"])
    got = dequantize_int4(ref["weight_packed"], ref["weight_scale"], k, ref["group"])
    assert torch.equal(got.float(), ref["dequantized"])
    assert (got - ref["weight"]).abs().max() < ref["weight"].abs().max() / 7   # it is the weight
    with pytest.raises(AssertionError):                      # nibbles in the other order fail
        swapped = unpack_int4(ref["weight_packed"], k).view(n, -1, 2).flip(-1).reshape(n, k)
        assert torch.equal(swapped, ref["q"])


def test_linear_is_the_dequantized_matmul(ref: dict) -> None:
    n, k = ref["weight_shape"].tolist()
    bias = torch.randn(n)
    layer = Int4Linear(ref["weight_packed"], ref["weight_scale"], k, ref["group"], bias)
    x = torch.randn(2, 5, k)                                 # odd rows, a batch of 2
    want = torch.nn.functional.linear(x, ref["dequantized"], bias)
    assert want.abs().mean() > 1
    torch.testing.assert_close(layer(x), want, rtol=1e-6, atol=1e-5)
    assert layer.weight_packed.nbytes * 4 == n * k * 2       # a quarter of bf16's bytes
    with pytest.raises(ValueError, match=r"weight_scale: \(N, K / 16\) expected"):
        Int4Linear(ref["weight_packed"], ref["weight_scale"], k, 16)


def test_pack_and_quantize_as_the_reference(ref: dict) -> None:
    """pack_int4 writes compressed-tensors' words (its pack_to_int32), quantize_int4 its
    symmetric groups (its minmax scale and quantize) from the float weight."""
    n, k = ref["weight_shape"].tolist()
    assert torch.equal(pack_int4(ref["q"]), ref["weight_packed"])
    packed, scale = quantize_int4(ref["weight"], ref["group"], torch.bfloat16)
    assert torch.equal(scale, ref["weight_scale"])
    assert torch.equal(packed, ref["weight_packed"])
    odd = torch.randint(-8, 8, (3, 13), dtype=torch.int8)          # K not whole words
    assert pack_int4(odd).shape == (3, 2)
    assert torch.equal(unpack_int4(pack_int4(odd), 13), odd)
