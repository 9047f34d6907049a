"""One tiny random Qwen2.5-Omni checkpoint and its transformers reference, shared by this
folder's tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.testing.tiny_qwen2_5_omni import build_tiny_qwen2_5_omni


@pytest.fixture(scope="session")
def omni25_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("omni25"))


@pytest.fixture(scope="session")
def omni25_hf(omni25_path: Path):
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(
        omni25_path, dtype=torch.float32).eval()
