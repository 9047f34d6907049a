"""LTX-2's latent upsampler (omnistage/models/ltx2_latent_upsampler.py) against diffusers'
`LTX2LatentUpsamplerModel` on tiny random weights saved with `save_pretrained` (float32): x2
through the rational resampler (the released config), x1.5 (its blur-stride), the plain
pixel shuffle, temporal x2, spatio-temporal x2 and the per-frame (dims=2) variant."""

from __future__ import annotations

import pytest
import torch

from omnistage.models.ltx2_latent_upsampler import LTX2LatentUpsampler
from tests.helpers.ltx2 import randomize

pytest.importorskip("diffusers")

CASES = {
    "x2-rational": {},
    "x1.5-rational": dict(rational_spatial_scale=1.5),
    "x2-shuffle": dict(use_rational_resampler=False),
    "temporal": dict(spatial_upsample=False, temporal_upsample=True),
    "spatiotemporal": dict(temporal_upsample=True),
    "dims2": dict(dims=2),
}


def tiny_upsampler(path, **overrides):
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    torch.manual_seed(3)
    ref = LTX2LatentUpsamplerModel(**{**dict(in_channels=8, mid_channels=32,
                                             num_blocks_per_stage=1), **overrides}).eval()
    randomize(ref, 0.15)
    ref.save_pretrained(path)
    return ref


@pytest.mark.parametrize("case", list(CASES))
def test_upsampler_matches_diffusers(tmp_path, case: str) -> None:
    ref = tiny_upsampler(tmp_path, **CASES[case])
    ours = LTX2LatentUpsampler.from_pretrained(tmp_path, "cpu", torch.float32)
    x = torch.randn(2, 8, 3, 4, 6, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = ref(x), ours(x)
    assert expected.abs().mean() > 0.1, float(expected.abs().mean())
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_upsampler_refuses_an_unknown_scale(tmp_path) -> None:
    tiny_upsampler(tmp_path)
    cfg = tmp_path / "config.json"
    cfg.write_text(cfg.read_text().replace('"rational_spatial_scale": 2.0',
                                           '"rational_spatial_scale": 3.0'))
    with pytest.raises(ValueError, match="rational_spatial_scale"):
        LTX2LatentUpsampler.from_pretrained(tmp_path)
