"""Our AutoencoderKLQwenImage against diffusers' on a tiny random checkpoint in float32: the same
posterior mean and sample, decode of images (one frame) and of videos (the causal time cache
across chunks), tiled encode and decode, the per-channel latent statistics, and loading that
fails by name on a missing, unexpected or mis-shaped tensor or an unknown config key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.models.autoencoder_kl_qwen_image import AutoencoderKLQwenImage

diffusers = pytest.importorskip("diffusers")

Z = 4
TINY = dict(base_dim=8, z_dim=Z, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
            temperal_downsample=[False, True, True],                 # Qwen-Image's layout: 8x
            latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 0.7, 2.0, 1.1])
WEIGHTS = "diffusion_pytorch_model.safetensors"
ATOL = 1e-4


def save_reference(path: Path) -> diffusers.AutoencoderKLQwenImage:
    torch.manual_seed(0)
    ref = diffusers.AutoencoderKLQwenImage(**TINY).eval()
    with torch.no_grad():   # RMS gammas start at one: perturb them so their layout matters
        for name, p in ref.named_parameters():
            if name.endswith("gamma"):
                p.add_(torch.randn_like(p) * 0.2)
    ref.save_pretrained(path)
    return ref


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[diffusers.AutoencoderKLQwenImage, AutoencoderKLQwenImage]:
    path = tmp_path_factory.mktemp("qwen_vae")
    return save_reference(path), AutoencoderKLQwenImage.from_pretrained(path)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("frames", [1, 5, 9], ids=["image", "video-5", "video-9"])
@torch.no_grad()
def test_encode_matches_diffusers(pair: tuple[diffusers.AutoencoderKLQwenImage,
                                              AutoencoderKLQwenImage], frames: int) -> None:
    ref, ours = pair
    videos = torch.rand(2, 3, frames, 32, 24, generator=torch.Generator().manual_seed(1)) * 2 - 1
    dist = ref.encode(videos).latent_dist
    mean = ours.encode(videos)
    assert mean.shape == (2, Z, 1 + (frames - 1) // 4, 4, 3)
    assert max_diff(mean, dist.mean) < ATOL
    sample = ours.sample_latents(videos, torch.Generator().manual_seed(7))
    assert max_diff(sample, dist.sample(torch.Generator().manual_seed(7))) < ATOL
    assert max_diff(sample, mean) > 1e-3                     # a draw, not the mean


@pytest.mark.parametrize("frames", [1, 2, 3], ids=["image", "video-2", "video-3"])
@torch.no_grad()
def test_decode_matches_diffusers(pair: tuple[diffusers.AutoencoderKLQwenImage,
                                              AutoencoderKLQwenImage], frames: int) -> None:
    ref, ours = pair
    latents = torch.randn(2, Z, frames, 4, 3, generator=torch.Generator().manual_seed(2))
    out = ours.decode(latents)
    assert out.shape == (2, 3, 1 + 4 * (frames - 1), 32, 24)
    assert max_diff(out, ref.decode(latents).sample) < ATOL
    assert out.std() > 0.05 and out.abs().max() <= 1.0       # not flat, clamped like diffusers


@torch.no_grad()
def test_tiled_decode_and_encode_match_diffusers(
        pair: tuple[diffusers.AutoencoderKLQwenImage, AutoencoderKLQwenImage]) -> None:
    ref, ours = pair
    ref.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=24,
                      tile_sample_stride_height=16, tile_sample_stride_width=16)
    try:
        g = torch.Generator().manual_seed(3)
        latents = torch.randn(1, Z, 1, 6, 5, generator=g)     # 3 x 3 tiles
        out = ours.decode_tiled(latents, tile=(32, 24), stride=(16, 16))
        assert out.shape == (1, 3, 1, 48, 40)
        assert max_diff(out, ref.decode(latents).sample) < ATOL
        assert max_diff(out, ours.decode(latents)) > 1e-3    # tiling really ran

        images = torch.rand(1, 3, 1, 48, 40, generator=g) * 2 - 1
        mean = ours.encode_tiled(images, tile=(32, 24), stride=(16, 16))
        assert max_diff(mean, ref.encode(images).latent_dist.mean) < ATOL
        assert max_diff(mean, ours.encode(images)) > 1e-4
    finally:
        ref.disable_tiling()
    small = latents[..., :4, :3]                             # fits one tile: plain decode
    torch.testing.assert_close(ours.decode_tiled(small, (32, 24), (16, 16)), ours.decode(small))


def test_latent_statistics_follow_the_config(
        pair: tuple[diffusers.AutoencoderKLQwenImage, AutoencoderKLQwenImage]) -> None:
    _, ours = pair
    z = torch.randn(1, Z, 1, 2, 2, generator=torch.Generator().manual_seed(4))
    mean = torch.tensor(TINY["latents_mean"]).view(1, Z, 1, 1, 1)
    std = torch.tensor(TINY["latents_std"]).view(1, Z, 1, 1, 1)
    torch.testing.assert_close(ours.denormalize(z), z * std + mean)
    torch.testing.assert_close(ours.normalize(ours.denormalize(z)), z)
    assert ours.cfg.downscale == 8


def test_refuses_bad_shapes(pair: tuple[diffusers.AutoencoderKLQwenImage,
                                        AutoencoderKLQwenImage]) -> None:
    _, ours = pair
    with pytest.raises(ValueError, match=r"latents: expected \(B, C, T, H, W\)"):
        ours.decode(torch.zeros(1, Z, 4, 4))
    with pytest.raises(ValueError, match="3 frames"):
        ours.encode(torch.zeros(1, 3, 3, 16, 16))


def test_missing_and_unexpected_tensors_are_named(tmp_path: Path) -> None:
    save_reference(tmp_path)
    weights = load_file(tmp_path / WEIGHTS)
    del weights["decoder.up_blocks.1.upsamplers.0.time_conv.bias"]
    weights["decoder.extra.weight"] = torch.zeros(1)
    save_file(weights, tmp_path / WEIGHTS)
    with pytest.raises(ValueError, match=r"missing tensors: decoder\.up_blocks\.1\.upsamplers\.0"
                                         r"\.time_conv\.bias.*unexpected.*decoder\.extra\.weight"):
        AutoencoderKLQwenImage.from_pretrained(tmp_path)


def test_misshaped_tensor_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path)
    weights = load_file(tmp_path / WEIGHTS)
    name = "encoder.down_blocks.0.norm1.gamma"
    weights[name] = weights[name].flatten()                  # (C,) instead of (C, 1, 1, 1)
    save_file(weights, tmp_path / WEIGHTS)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        AutoencoderKLQwenImage.from_pretrained(tmp_path)


def test_unknown_config_key_fails(tmp_path: Path) -> None:
    save_reference(tmp_path)
    config = tmp_path / "config.json"
    config.write_text(config.read_text().replace('"z_dim"', '"z_dims"'))
    with pytest.raises(ValueError, match="z_dims"):
        AutoencoderKLQwenImage.from_pretrained(tmp_path)
