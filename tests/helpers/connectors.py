"""Shared payloads for connector tests (the unit and system tiers' conftests import the
fixtures): every dtype family, odd shapes, non-contiguous input."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
import torch
from torch import Tensor


def make_payload(seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(6, 10, generator=g)
    return {
        "f32": torch.randn(2, 3, 4, generator=g),                        # 3-D
        "f16": torch.randn(5, generator=g).to(torch.float16),
        "bf16": torch.randn(3, 7, generator=g).to(torch.bfloat16),        # numpy has no bfloat16
        "i64": torch.arange(-5, 6, dtype=torch.int64),
        "i8": torch.randint(-128, 128, (4, 4), generator=g, dtype=torch.int8),
        "bool": torch.rand(9, generator=g) > 0.5,
        "u8": torch.randint(0, 256, (3, 1, 2), generator=g, dtype=torch.uint8),
        "scalar": torch.tensor(3.5),                                      # 0-d
        "scalar_i64": torch.tensor(-7),
        "empty": torch.empty(0, 4),
        "empty_bf16": torch.empty(2, 0, 3, dtype=torch.bfloat16),
        "strided": wide.t()[::2],                                         # (5, 6), non-contiguous
    }


def check_same(got: Mapping[str, Tensor], want: Mapping[str, Tensor]) -> None:
    assert list(got) == list(want), (list(got), list(want))
    for name, t in want.items():
        assert got[name].dtype == t.dtype, (name, got[name].dtype, t.dtype)
        assert got[name].shape == t.shape, (name, got[name].shape, t.shape)
        assert got[name].is_contiguous(), name
        assert torch.equal(got[name], t), name


@pytest.fixture
def payload() -> dict[str, Tensor]:
    return make_payload()


@pytest.fixture
def assert_same() -> Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], None]:
    return check_same
