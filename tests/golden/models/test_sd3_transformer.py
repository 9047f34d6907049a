"""Our SD3Transformer2DModel against diffusers' on tiny random checkpoints: SD3.0 (plain joint
blocks) and SD3.5 (qk RMS-norm, 3.5-medium's dual-attention blocks) give the same outputs in
float32, with and without skipped layers (skip-layer guidance); a bad config or a latent past
the position table fails by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from omnistage.models.sd3_transformer import SD3Transformer2DModel, SD3TransformerConfig

diffusers = pytest.importorskip("diffusers")

TINY = dict(sample_size=16, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=16,
            pooled_projection_dim=12, out_channels=4, pos_embed_max_size=12)
VARIANTS = {"sd3": {"out_channels": None}, "sd35_large": {"qk_norm": "rms_norm"},
            "sd35_medium": {"qk_norm": "rms_norm", "dual_attention_layers": (0, 1)}}
B, T, H, W = 2, 5, 6, 10           # latent pixels: a 3x5 patch grid, off the table's centre


def save_reference(path: Path, **extra: object) -> diffusers.SD3Transformer2DModel:
    torch.manual_seed(0)
    ref = diffusers.SD3Transformer2DModel(**{**TINY, **extra}).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():  # diffusers zero-inits some: make every path count
            if name != "pos_embed.pos_embed":
                p.normal_(0.0, 0.2)
    ref.save_pretrained(path)
    return ref


def inputs() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(B, TINY["in_channels"], H, W, generator=g),
                encoder_hidden_states=torch.randn(B, T, TINY["joint_attention_dim"], generator=g),
                pooled_projections=torch.randn(B, TINY["pooled_projection_dim"], generator=g),
                timestep=torch.tensor([1000.0, 412.5]))       # the scheduler's timesteps


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_diffusers(tmp_path: Path, variant: str) -> None:
    ref = save_reference(tmp_path, **VARIANTS[variant])
    ours = SD3Transformer2DModel.from_pretrained(tmp_path, "cpu", torch.float32)
    x = inputs()
    with torch.no_grad():
        expected = ref(**x, return_dict=False)[0]
        got = ours(**x)
        skipped = ref(**x, return_dict=False, skip_layers=[1])[0]
        got_skipped = ours(**x, skip_layers=(1,))
    assert got.shape == (B, TINY["out_channels"], H, W)
    assert expected.abs().mean() > 0.1, "the reference output should not be near zero"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_skipped, skipped, atol=1e-5, rtol=1e-4)
    assert (skipped - expected).abs().max() > 1e-2, "skipping a layer should change the output"


def test_bad_config_and_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="qk_norm 'layer_norm'"):
        SD3TransformerConfig(qk_norm="layer_norm")
    with pytest.raises(ValueError, match="caption_projection_dim 32"):
        SD3TransformerConfig(**{**TINY, "caption_projection_dim": 32})
    with pytest.raises(ValueError, match=r"dual_attention_layers \[5\]"):
        SD3TransformerConfig(**TINY, dual_attention_layers=(5,))
    save_reference(tmp_path)
    ours = SD3Transformer2DModel.from_pretrained(tmp_path, "cpu", torch.float32)
    x = inputs()
    x["hidden_states"] = torch.randn(1, TINY["in_channels"], 2 * 13, 4)
    with pytest.raises(ValueError, match="13x2 patches.*pos_embed_max_size=12"):
        ours(**{k: v[:1] for k, v in x.items()})
