"""Fixtures of the engine tests: a digits model with random weights (the shipped demo's
architecture), saved once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.models.digits_dit import DigitsDiT, DigitsDiTConfig


@pytest.fixture(scope="session")
def random_digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = DigitsDiT(DigitsDiTConfig(hidden_size=64, num_layers=2, num_heads=4))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("digits")
    model.save_pretrained(path)
    return path
