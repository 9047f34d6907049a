"""Golden: our CLIP vision encoder against transformers' CLIPVisionModel on a tiny random
checkpoint (float32): hidden_states[-2] (what Wan2.1 image-to-video reads) and [-1], from the
transformers 5 layout and the older "vision_model."-prefixed one; loading fails by name on a
missing tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel

from omnistage.models.clip_vision import CLIPVisionEncoder
from omnistage.testing.tiny_models import edit_checkpoint

CONFIG = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
              image_size=32, patch_size=8, hidden_act="gelu")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CLIPVisionModel]:
    torch.manual_seed(0)
    model = CLIPVisionModel(CLIPVisionConfig(**CONFIG)).eval()
    with torch.no_grad():   # HF's unit norms and zero biases would hide a swapped norm or bias
        for name, p in model.named_parameters():
            p.normal_(1.0 if p.dim() == 1 and "norm" in name and name.endswith("weight")
                      else 0.0, 0.3 if p.dim() > 1 else 0.1)
    path = tmp_path_factory.mktemp("clip_vision")
    model.save_pretrained(path)
    return path, model


def hidden(model: nn.Module, pixels: torch.Tensor, idx: int) -> torch.Tensor:
    with torch.no_grad():
        return model(pixel_values=pixels, output_hidden_states=True).hidden_states[idx]


@pytest.mark.parametrize("idx", [-2, -1])
def test_matches_transformers(reference: tuple[Path, CLIPVisionModel], idx: int) -> None:
    path, ref = reference
    ours = CLIPVisionEncoder.from_pretrained(path, hidden_layer=idx)
    assert len(ours.encoder.layers) == CONFIG["num_hidden_layers"] + 1 + idx
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    expected = hidden(ref, pixels, idx)                                  # (2, 17, 16)
    assert expected.shape == (2, 17, 16) and expected.abs().max() > 1.0
    with torch.no_grad():
        got = ours(pixels)
    assert (got - expected).abs().max() < 1e-5
    assert (got - hidden(ref, pixels, idx - 1)).abs().max() > 0.1      # a layer off would fail


def test_old_prefixed_layout_and_missing_tensor(reference: tuple[Path, CLIPVisionModel],
                                                tmp_path: Path) -> None:
    path, ref = reference
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())

    def prefix(tensors: dict) -> None:
        for key in list(tensors):
            tensors["vision_model." + key] = tensors.pop(key)

    edit_checkpoint(tmp_path, prefix)
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = CLIPVisionEncoder.from_pretrained(tmp_path)(pixels)
    assert (got - hidden(ref, pixels, -2)).abs().max() < 1e-5
    edit_checkpoint(tmp_path, lambda t: t.pop("vision_model.pre_layrnorm.bias"))
    with pytest.raises(ValueError, match="pre_layrnorm.bias"):
        CLIPVisionEncoder.from_pretrained(tmp_path)
