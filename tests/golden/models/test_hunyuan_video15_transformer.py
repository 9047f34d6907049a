"""Golden: our HunyuanVideo-1.5 transformer against diffusers' `HunyuanVideo15Transformer3DModel`
on the same tiny random weights (loaded by our loader from the saved folder), float32: a batch
of 2 at different timesteps with captions and glyph texts of different lengths (one row
without glyph text), an odd latent grid (2 x 3 x 5), text-to-video (diffusers' all-zero image
embeds, ours none) and image-to-video (SigLIP tokens), and a MeanFlow checkpoint's timestep_r."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.models.hunyuan_video15_transformer import HunyuanVideo15Transformer3DModel
from tests.helpers.hunyuan_video15 import (IMAGE_DIM, LATENT, NUM_IMAGE_TOKENS, conditioning,
                                           tiny_transformer)

pytest.importorskip("diffusers")


def _inputs(image: bool) -> dict:
    g = torch.Generator().manual_seed(3)
    kw = conditioning(2, lengths=[9, 4], glyph_lengths=[3, 0])
    kw["hidden_states"] = torch.randn(2, 2 * LATENT + 1, 2, 3, 5, generator=g)
    kw["timestep"] = torch.tensor([900.0, 250.0])
    kw["image_embeds"] = (torch.randn(2, NUM_IMAGE_TOKENS, IMAGE_DIM, generator=g) if image
                          else torch.zeros(2, NUM_IMAGE_TOKENS, IMAGE_DIM))
    return kw


def _compare(tmp_path: Path, image: bool, use_meanflow: bool = False) -> torch.Tensor:
    ref = tiny_transformer("i2v" if image else "t2v", use_meanflow)
    ref.save_pretrained(tmp_path)
    ours = HunyuanVideo15Transformer3DModel.from_pretrained(tmp_path)
    kw = _inputs(image)
    if use_meanflow:
        kw["timestep_r"] = torch.tensor([750.0, 0.0])
    with torch.no_grad():
        expected = ref(**kw, return_dict=False)[0]
        ours_kw = dict(kw, image_embeds=kw["image_embeds"] if image else None)
        got = ours(**ours_kw)
    assert expected.shape == (2, LATENT, 2, 3, 5)
    assert expected.abs().mean() > 0.3, float(expected.abs().mean())
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    return got


def test_text_to_video_matches_diffusers(tmp_path: Path) -> None:
    _compare(tmp_path, image=False)


def test_image_to_video_matches_diffusers(tmp_path: Path) -> None:
    got = _compare(tmp_path, image=True)
    ours = HunyuanVideo15Transformer3DModel.from_pretrained(tmp_path)
    with torch.no_grad():        # the image tokens matter: without them the output differs
        without = ours(**dict(_inputs(True), image_embeds=None))
    assert (without - got).abs().max() > 1e-2


def test_meanflow_timestep_r_matches_diffusers(tmp_path: Path) -> None:
    _compare(tmp_path, image=True, use_meanflow=True)


def test_each_row_alone_equals_the_batch(tmp_path: Path) -> None:
    """The compacted context of a row does not depend on its batch neighbours' lengths."""
    tiny_transformer().save_pretrained(tmp_path)
    ours = HunyuanVideo15Transformer3DModel.from_pretrained(tmp_path)
    kw = dict(_inputs(False), image_embeds=None)
    with torch.no_grad():
        both = ours(**kw)
        second = ours(**{k: v[1:] for k, v in kw.items() if v is not None})
    torch.testing.assert_close(second, both[1:], atol=1e-5, rtol=1e-5)


def test_refuses_what_is_not_built(tmp_path: Path) -> None:
    ref = tiny_transformer()
    ref.save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(config.replace('"qk_norm"', '"attn_mode": "ssta",\n'
                                                         '  "qk_norm"'))
    with pytest.raises(ValueError, match=r"unknown keys \['attn_mode'\]"):
        HunyuanVideo15Transformer3DModel.from_pretrained(tmp_path)
    ours_in = torch.zeros(1, 2 * LATENT, 1, 2, 2)
    (tmp_path / "config.json").write_text(config)
    ours = HunyuanVideo15Transformer3DModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="hidden_states must be"):
        ours(ours_in, torch.zeros(1), **{k: v[:1] for k, v in conditioning(1, [2], [0]).items()})
