"""Our SiglipVisionEncoder against transformers' SiglipVisionModel (`last_hidden_state`) on a
tiny random checkpoint in float32: a batch of 2 images, the checkpoint saved by transformers 5
(no prefix) and in the older `vision_model.` layout, the pooling head skipped, strict
loading and the input shape check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from omnistage.models.siglip_vision import SiglipVisionEncoder
from tests.helpers.hunyuan_video15_parts import TINY_SIGLIP, build_tiny_siglip

ATOL = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("siglip")
    build_tiny_siglip(path)
    return path


def pixels(seed: int) -> torch.Tensor:
    size = TINY_SIGLIP["image_size"]
    return torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@torch.no_grad()
def test_matches_transformers(folder: Path) -> None:
    ref = transformers.SiglipVisionModel.from_pretrained(folder).eval()
    ours = SiglipVisionEncoder.from_pretrained(folder)
    x = pixels(1)
    expected = ref(pixel_values=x).last_hidden_state
    got = ours(x)
    num_patches = (TINY_SIGLIP["image_size"] // TINY_SIGLIP["patch_size"]) ** 2
    assert got.shape == expected.shape == (2, num_patches, TINY_SIGLIP["hidden_size"])
    assert expected.std() > 0.3 and (expected[0] - expected[1]).abs().max() > 0.1
    assert (got - expected).abs().max().item() < ATOL


@torch.no_grad()
def test_loads_the_vision_model_prefixed_layout(folder: Path, tmp_path: Path) -> None:
    for name in ("config.json",):
        (tmp_path / name).write_text((folder / name).read_text())
    weights = load_file(folder / "model.safetensors")
    save_file({f"vision_model.{k}": v for k, v in weights.items()}, tmp_path / "model.safetensors")
    x = pixels(2)
    torch.testing.assert_close(SiglipVisionEncoder.from_pretrained(tmp_path)(x),
                               SiglipVisionEncoder.from_pretrained(folder)(x), rtol=0, atol=0)


def test_strict_loading_and_input_check(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    assert any(k.startswith("head.") for k in weights)        # the pooling head, skipped
    del weights["encoder.layers.1.mlp.fc2.bias"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"encoder\.layers\.1\.mlp\.fc2\.bias"):
        SiglipVisionEncoder.from_pretrained(tmp_path)
    ours = SiglipVisionEncoder.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"pixel_values: expected \(B, 3, 28, 28\)"):
        ours(torch.zeros(1, 3, 28, 21))
