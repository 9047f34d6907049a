"""Qwen2.5-VL's vision tower against transformers' on the same tiny random weights: two images
of different grids, whose merged grids do not divide into whole windows (the last windows are
smaller), one window-attention block and one full-attention block; and the multimodal rotary
of our Qwen text encoder against transformers' language model on the same positions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer, window_layout
from omnistage.models.text_encoders import QwenTextEncoder

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default"}),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2,
                           out_hidden_size=16, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1]),
        vocab_size=64)).eval()
    with torch.no_grad():
        for p in model.model.visual.parameters():
            p.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    model.save_pretrained(path)
    return path


def test_window_layout_cuts_partial_windows() -> None:
    """A 3x4 merged grid in windows of 2: [0 1 4 5] [2 3 6 7] [8 9] [10 11]."""
    order, cu = window_layout([(1, 6, 8)], merge=2, window=2)
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 10, 11]
    assert cu == [0, 16, 32, 40, 48]                          # in patches: 4 per merged token


def test_vision_tower_equals_transformers(folder: Path) -> None:
    ref = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()
    ours = Qwen2_5_VisionTransformer.from_pretrained(folder, "cpu", torch.float32)
    grid = torch.tensor([[1, 6, 8], [1, 10, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), ours.cfg.patch_dim)
    with torch.no_grad():
        expected = ref.model.visual(pixels, grid).pooler_output           # (N / 4, 16)
        got = ours(pixels, grid)
    assert got.shape == expected.shape == (22, 16) and expected.abs().mean() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_multimodal_rotary_equals_transformers(folder: Path) -> None:
    ref = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()
    ours = QwenTextEncoder.from_pretrained(folder, "cpu", torch.float32)
    ids = torch.randint(0, 64, (1, 9))
    positions = torch.tensor([[0, 1, 2, 2, 2, 2, 4, 5, 6], [0, 1, 2, 2, 3, 3, 4, 5, 6],
                              [0, 1, 2, 3, 2, 3, 4, 5, 6]])[:, None]     # a 2x2 image
    with torch.no_grad():
        expected = ref.model.language_model(input_ids=ids, position_ids=positions
                                            ).last_hidden_state
        got = ours(ids, None, (-1,), position_ids=positions)[-1]
        plain = ours(ids, None, (-1,))[-1]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (got - plain).abs().max() > 1e-3                    # the positions change the states
