"""Our AutoencoderKLHunyuanVideo15 against diffusers' on tiny random checkpoints in float32
(8x in space with a space-only and two space-and-time resamplers, 4x in time; and the same
with unmatched resampler channels and two layers per block): the posterior mean of batches of
2 videos of 1, 5 and 9 frames at a non-square size, decode of 1, 2 and 3 latent frames, tiled
decode and encode against diffusers' `enable_tiling`, the scaling factor, the frame and size
rules, the published layout, and strict loading.

diffusers 0.42's VAE cannot take a batch of more than one video: its attention mask is
(B, S, S) against (B, 1, S, C) queries, which SDPA broadcasts to (B, B, S, S) and refuses.
With `enable_slicing()` it runs the batch one video at a time, the reference here; ours runs
the batch at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.models.autoencoder_kl_hunyuan_video15 import (AutoencoderKLHunyuanVideo15,
                                                             AutoencoderKLHunyuanVideo15Config)
from tests.helpers.hunyuan_video15_parts import LATENT_CHANNELS, TINY_VAE, build_tiny_vae

diffusers = pytest.importorskip("diffusers")

VARIANTS = {"tiny": {}, "unmatched": dict(downsample_match_channel=False,
                                          upsample_match_channel=False, layers_per_block=2)}
R = 8                # TINY_VAE's spatial factor
WEIGHTS = "diffusion_pytorch_model.safetensors"
ATOL = 1e-5


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[diffusers.AutoencoderKLHunyuanVideo15, AutoencoderKLHunyuanVideo15]:
    path = tmp_path_factory.mktemp(request.param)
    ref = build_tiny_vae(path, **VARIANTS[request.param])
    ref.enable_slicing()   # its mid-block attention fails on batches > 1 (mask (B, S, S))
    return ref, AutoencoderKLHunyuanVideo15.from_pretrained(path)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def videos(frames: int, h: int, w: int, seed: int, batch: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, frames, h * R, w * R, generator=gen) * 2 - 1


@pytest.mark.parametrize("frames", [1, 5, 9])
@torch.no_grad()
def test_encode_matches_diffusers(pair: tuple[diffusers.AutoencoderKLHunyuanVideo15,
                                              AutoencoderKLHunyuanVideo15], frames: int) -> None:
    ref, ours = pair
    x = videos(frames, 5, 3, seed=frames)                     # odd latent size 5 x 3
    dist = ref.encode(x).latent_dist
    mean = ours.encode(x)
    assert mean.shape == (2, LATENT_CHANNELS, 1 + (frames - 1) // 4, 5, 3)
    assert dist.mean.std() > 0.1                               # a scale the tolerance means
    assert max_diff(mean, dist.mean) < ATOL
    assert max_diff(mean[0], mean[1]) > 1e-2                   # the two videos differ
    _, logvar = ours.moments(x)
    assert max_diff(logvar, dist.logvar) < ATOL


@pytest.mark.parametrize("frames", [1, 2, 3])
@torch.no_grad()
def test_decode_matches_diffusers(pair: tuple[diffusers.AutoencoderKLHunyuanVideo15,
                                              AutoencoderKLHunyuanVideo15], frames: int) -> None:
    ref, ours = pair
    latents = torch.randn(2, LATENT_CHANNELS, frames, 5, 3,
                          generator=torch.Generator().manual_seed(10 + frames))
    out = ours.decode(latents)
    assert out.shape == (2, 3, 1 + 4 * (frames - 1), 5 * R, 3 * R)
    expected = ref.decode(latents).sample
    assert expected.std() > 0.05                               # not flat
    assert max_diff(out, expected) < ATOL


@torch.no_grad()
def test_tiled_decode_matches_diffusers(pair: tuple[diffusers.AutoencoderKLHunyuanVideo15,
                                                    AutoencoderKLHunyuanVideo15]) -> None:
    ref, ours = pair
    tile = 4 * R                                               # 4-latent tiles every 3
    latents = torch.randn(1, LATENT_CHANNELS, 2, 7, 6, generator=torch.Generator().manual_seed(3))
    ref.enable_tiling(tile, tile, tile // R, tile // R, 0.25)
    try:
        expected = ref.decode(latents).sample
    finally:
        ref.disable_tiling()
    out = ours.decode_tiled(latents, tile=tile)
    assert out.shape == (1, 3, 5, 7 * R, 6 * R)
    assert max_diff(out, expected) < ATOL
    assert max_diff(out, ours.decode(latents)) > 1e-3          # tiling really ran
    small = latents[..., :4, :3]                               # fits one tile: plain decode
    torch.testing.assert_close(ours.decode_tiled(small, tile), ours.decode(small))


@torch.no_grad()
def test_tiled_encode_matches_diffusers(pair: tuple[diffusers.AutoencoderKLHunyuanVideo15,
                                                    AutoencoderKLHunyuanVideo15]) -> None:
    ref, ours = pair
    tile = 4 * R
    x = videos(5, 7, 6, seed=4, batch=1)
    ref.enable_tiling(tile, tile, tile // R, tile // R, 0.25)
    try:
        expected = ref.encode(x).latent_dist.mean
    finally:
        ref.disable_tiling()
    mean = ours.encode_tiled(x, tile=tile)
    assert max_diff(mean, expected) < ATOL
    assert max_diff(mean, ours.encode(x)) > 1e-4


def test_factors_and_scaling(pair: tuple[diffusers.AutoencoderKLHunyuanVideo15,
                                         AutoencoderKLHunyuanVideo15]) -> None:
    ref, ours = pair
    assert ours.cfg.downscale == ref.spatial_compression_ratio == R
    assert ours.cfg.temporal_downscale == ref.temporal_compression_ratio == 4
    z = torch.randn(1, LATENT_CHANNELS, 1, 2, 2, generator=torch.Generator().manual_seed(5))
    assert torch.equal(ours.normalize(z), z * ref.config.scaling_factor)
    assert torch.equal(ours.denormalize(z), z / ref.config.scaling_factor)


def test_refuses_bad_frames_sizes_and_channels(
        pair: tuple[diffusers.AutoencoderKLHunyuanVideo15, AutoencoderKLHunyuanVideo15]) -> None:
    _, ours = pair
    with pytest.raises(ValueError, match=r"6 frames; the encoder takes 1 \+ 4 k"):
        ours.encode(torch.zeros(1, 3, 6, R, R))
    with pytest.raises(ValueError, match=f"{R + 4}x{R}.*spatial factor {R}"):
        ours.encode(torch.zeros(1, 3, 1, R + 4, R))
    with pytest.raises(ValueError, match="1 channels, the VAE takes 3"):
        ours.encode_tiled(torch.zeros(1, 1, 1, R, R))
    with pytest.raises(ValueError, match=f"2 channels, the VAE has latent_channels="
                                         f"{LATENT_CHANNELS}"):
        ours.decode(torch.zeros(1, 2, 1, 2, 2))
    with pytest.raises(ValueError, match=r"latents: expected \(B, C, T, H, W\)"):
        ours.decode_tiled(torch.zeros(1, LATENT_CHANNELS, 4, 4))


def test_published_config_has_diffusers_tensors() -> None:
    """The full-size layout (diffusers' defaults, as HunyuanVideo-1.5's vae/config.json),
    built on the meta device: every name and shape as diffusers'."""
    with torch.device("meta"):
        ref = diffusers.AutoencoderKLHunyuanVideo15()
        ours = AutoencoderKLHunyuanVideo15(AutoencoderKLHunyuanVideo15Config())
    assert ({k: v.shape for k, v in ours.state_dict().items()}
            == {k: v.shape for k, v in ref.state_dict().items()})
    assert ours.cfg.scaling_factor == ref.config.scaling_factor


def test_missing_and_unexpected_tensors_are_named(tmp_path: Path) -> None:
    build_tiny_vae(tmp_path)
    weights = load_file(tmp_path / WEIGHTS)
    del weights["decoder.up_blocks.0.upsamplers.0.conv.conv.bias"]
    weights["encoder.down_blocks.0.extra.weight"] = torch.zeros(1)
    save_file(weights, tmp_path / WEIGHTS)
    with pytest.raises(ValueError, match=r"missing tensors: decoder\.up_blocks\.0\.upsamplers"
                                         r"\.0\.conv\.conv\.bias.*unexpected.*down_blocks\.0"
                                         r"\.extra"):
        AutoencoderKLHunyuanVideo15.from_pretrained(tmp_path)


def test_config_is_checked(tmp_path: Path) -> None:
    build_tiny_vae(tmp_path)
    config = tmp_path / "config.json"
    text = config.read_text()
    config.write_text(text.replace('"latent_channels"', '"latent_channel"'))
    with pytest.raises(ValueError, match="unknown keys.*latent_channel"):
        AutoencoderKLHunyuanVideo15.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="temporal_compression_ratio=3: must be a power of two"):
        AutoencoderKLHunyuanVideo15Config(**{**TINY_VAE, "temporal_compression_ratio": 3})


@torch.no_grad()
def test_bfloat16_follows_diffusers(tmp_path: Path) -> None:
    """Loaded in bfloat16 (the real checkpoint's dtype): decode and encode stay within bf16
    rounding of diffusers' model cast to bfloat16 (the norms normalise in float32 on both)."""
    ref = build_tiny_vae(tmp_path).to(torch.bfloat16)
    ours = AutoencoderKLHunyuanVideo15.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert next(ours.parameters()).dtype == torch.bfloat16
    latents = torch.randn(1, LATENT_CHANNELS, 2, 3, 2, generator=torch.Generator().manual_seed(6))
    expected = ref.decode(latents.to(torch.bfloat16)).sample.float()
    out = ours.decode(latents.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert (out.float() - expected).abs().max() < 0.05 * expected.abs().max()
    x = videos(5, 3, 2, seed=7, batch=1).to(torch.bfloat16)
    mean = ref.encode(x).latent_dist.mean.float()
    assert (ours.encode(x).float() - mean).abs().max() < 0.05 * mean.abs().max()
