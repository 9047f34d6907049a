"""Our GlmImageTransformer2DModel against diffusers' on a tiny random checkpoint: the same
output in float32 for conditional and dropped-prior rows at different timesteps; rows padded to
a longer glyph text with `text_mask` equal their unpadded selves; a condition image's keys and
values (`condition_kv`) attended to as diffusers' GlmImageKVCache writes and reads them, and
masked out, padding included, where a row has none; bad configs and inputs fail by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from omnistage.models.glm_image_transformer import (GlmImageTransformer2DModel,
                                                    GlmImageTransformerConfig)

diffusers = pytest.importorskip("diffusers")

TINY = dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
            num_attention_heads=2, text_embed_dim=12, time_embed_dim=16, condition_dim=8,
            prior_vq_quantizer_codebook_size=32)
B, T, H, W = 2, 5, 6, 10           # a 3x5 patch grid: rows and columns of the rope differ


def save_reference(path: Path) -> diffusers.GlmImageTransformer2DModel:
    torch.manual_seed(0)
    ref = diffusers.GlmImageTransformer2DModel(**TINY).eval()
    with torch.no_grad():
        for p in ref.parameters():    # diffusers zero-inits some: make every path count
            p.normal_(0.0, 0.2)
    ref.save_pretrained(path)
    return ref


def inputs() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1)
    n = (H // 2) * (W // 2)
    return dict(hidden_states=torch.randn(B, TINY["in_channels"], H, W, generator=g),
                encoder_hidden_states=torch.randn(B, T, TINY["text_embed_dim"], generator=g),
                prior_token_id=torch.randint(0, 32, (B, n), generator=g),
                prior_token_drop=torch.tensor([[False], [True]]).expand(B, n),
                timestep=torch.tensor([999.0, 411.0]),
                target_size=torch.tensor([[48.0, 80.0]] * B),
                crop_coords=torch.tensor([[0.0, 0.0], [16.0, 8.0]]))


def test_matches_diffusers(tmp_path: Path) -> None:
    ref = save_reference(tmp_path)
    ours = GlmImageTransformer2DModel.from_pretrained(tmp_path, "cpu", torch.float32)
    x = inputs()
    with torch.no_grad():
        expected = ref(**x, return_dict=False)[0]
        got = ours(**x)
    assert got.shape == (B, TINY["out_channels"], H, W)
    assert expected.abs().mean() > 0.1, "the reference output should not be near zero"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    # the dropped row differs from what it would be with its prior: the drop is exercised
    x["prior_token_drop"] = torch.zeros_like(x["prior_token_drop"])
    with torch.no_grad():
        assert (ours(**x)[1] - got[1]).abs().max() > 1e-2


def test_text_mask_hides_padding(tmp_path: Path) -> None:
    save_reference(tmp_path)
    ours = GlmImageTransformer2DModel.from_pretrained(tmp_path, "cpu", torch.float32)
    x = inputs()
    padded = dict(x, encoder_hidden_states=torch.cat(
        [x["encoder_hidden_states"], torch.randn(B, 3, TINY["text_embed_dim"])], dim=1))
    mask = torch.ones(B, T + 3, dtype=torch.bool)
    mask[:, T:] = False
    with torch.no_grad():
        torch.testing.assert_close(ours(**padded, text_mask=mask), ours(**x),
                                   atol=1e-5, rtol=1e-4)


def test_condition_kv_matches_diffusers_cache(tmp_path: Path) -> None:
    """Row 0 attends to a 4x6-latent condition image (diffusers: "write" it, then "read"
    with a one-row batch); row 1 has none, its image_kv slot padded and masked out."""
    from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

    ref = save_reference(tmp_path)
    ours = GlmImageTransformer2DModel.from_pretrained(tmp_path, "cpu", torch.float32)
    g = torch.Generator().manual_seed(2)
    cond = torch.randn(1, TINY["in_channels"], 4, 6, generator=g)
    cond_prior = torch.randint(0, 32, (1, 6), generator=g)
    x = inputs()
    cache = GlmImageKVCache(TINY["num_layers"])
    with torch.no_grad():
        cache.set_mode("write")
        ref(cond, torch.zeros(1, 0, TINY["text_embed_dim"]), cond_prior,
            torch.zeros_like(cond_prior, dtype=torch.bool), torch.zeros(1),
            torch.tensor([[32, 48]]), torch.zeros(1, 2), kv_caches=cache)
        cache.set_mode("read")
        expected = ref(**{k: v[:1] for k, v in x.items()}, kv_caches=cache,
                       return_dict=False)[0]
        kv = ours.condition_kv(cond, cond_prior, torch.tensor([[32.0, 48.0]]))   # (L,2,6,H,hd)
        rows = torch.cat([kv[:, :, None], torch.randn_like(kv[:, :, None])], dim=2)
        mask = torch.tensor([[True] * 6, [False] * 6])
        got = ours(**x, image_kv=rows, image_kv_mask=mask)
        alone = ours(**{k: v[1:] for k, v in x.items()})
    assert kv.shape == (TINY["num_layers"], 2, 6, 2, 8)
    torch.testing.assert_close(got[:1], expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[1:], alone, atol=1e-5, rtol=1e-4)
    with torch.no_grad():       # the condition matters: without it row 0 differs
        assert (ours(**x)[:1] - expected).abs().max() > 1e-2


def test_bad_config_and_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="attention_head_dim 6"):
        GlmImageTransformerConfig(attention_head_dim=6)
    save_reference(tmp_path)
    ours = GlmImageTransformer2DModel.from_pretrained(tmp_path, "cpu", torch.float32)
    x = inputs()
    with pytest.raises(ValueError, match=r"prior_token_id \(2, 14\)"):
        ours(**dict(x, prior_token_id=x["prior_token_id"][:, 1:]))
    with pytest.raises(ValueError, match="latent 6x9"):
        ours(**dict(x, hidden_states=x["hidden_states"][..., 1:]))
