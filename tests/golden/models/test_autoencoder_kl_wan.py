"""Our AutoencoderKLWan against diffusers' on tiny random checkpoints in float32, a Wan 2.1-like
one (8x in space) and a Wan 2.2-TI2V-like one (residual resampling stages, 2x2 patchify, 16x):
the posterior mean and sample of videos of 1, 5 and 9 frames at a non-square size, decode of 1,
2 and 3 latent frames (the causal time cache across chunks), tiled decode and encode against
diffusers' `enable_tiling`, the frame and size rules, and strict loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.models.autoencoder_kl_wan import AutoencoderKLWan, AutoencoderKLWanConfig

diffusers = pytest.importorskip("diffusers")

COMMON = dict(base_dim=8, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
              temperal_downsample=[False, True, True])
CONFIGS = {
    "wan21": dict(COMMON, z_dim=4, latents_mean=[0.1, -0.2, 0.3, -0.4],
                  latents_std=[1.5, 0.7, 2.0, 1.1]),
    "wan22": dict(COMMON, decoder_base_dim=12, z_dim=6, is_residual=True, in_channels=12,
                  out_channels=12, patch_size=2, scale_factor_spatial=16,
                  latents_mean=[0.1, -0.2, 0.3, -0.4, 0.5, 0.0],
                  latents_std=[1.5, 0.7, 2.0, 1.1, 0.9, 1.3]),
}
FACTOR = {"wan21": 8, "wan22": 16}
# the published vae/config.json of Wan2.2-TI2V-5B-Diffusers (statistics left out);
# Wan 2.1's is diffusers' defaults
TI2V_5B = dict(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12,
               out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
               latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
WEIGHTS = "diffusion_pytorch_model.safetensors"
ATOL = 1e-5


def save_reference(name: str, path: Path) -> diffusers.AutoencoderKLWan:
    torch.manual_seed(0)
    ref = diffusers.AutoencoderKLWan(**CONFIGS[name]).eval()
    with torch.no_grad():   # RMS gammas start at one: perturb them so their layout matters
        for key, p in ref.named_parameters():
            if key.endswith("gamma"):
                p.add_(torch.randn_like(p) * 0.2)
    ref.save_pretrained(path)
    return ref


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[str, diffusers.AutoencoderKLWan, AutoencoderKLWan]:
    path = tmp_path_factory.mktemp(request.param)
    ref = save_reference(request.param, path)
    return request.param, ref, AutoencoderKLWan.from_pretrained(path)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("frames", [1, 5, 9])
@torch.no_grad()
def test_encode_matches_diffusers(pair: tuple[str, diffusers.AutoencoderKLWan,
                                              AutoencoderKLWan], frames: int) -> None:
    name, ref, ours = pair
    r = FACTOR[name]
    videos = torch.rand(2, 3, frames, 5 * r, 3 * r,            # odd latent size 5 x 3
                        generator=torch.Generator().manual_seed(1)) * 2 - 1
    dist = ref.encode(videos).latent_dist
    mean = ours.encode(videos)
    assert mean.shape == (2, ours.cfg.z_dim, 1 + (frames - 1) // 4, 5, 3)
    assert dist.mean.std() > 0.1                               # a scale the tolerance means
    assert max_diff(mean, dist.mean) < ATOL
    sample = ours.sample_latents(videos, torch.Generator().manual_seed(7))
    assert max_diff(sample, dist.sample(torch.Generator().manual_seed(7))) < ATOL
    assert max_diff(sample, mean) > 1e-3                       # a draw, not the mean


@pytest.mark.parametrize("frames", [1, 2, 3])
@torch.no_grad()
def test_decode_matches_diffusers(pair: tuple[str, diffusers.AutoencoderKLWan,
                                              AutoencoderKLWan], frames: int) -> None:
    name, ref, ours = pair
    r = FACTOR[name]
    latents = torch.randn(2, ours.cfg.z_dim, frames, 5, 3,
                          generator=torch.Generator().manual_seed(2))
    out = ours.decode(latents)
    assert out.shape == (2, 3, 1 + 4 * (frames - 1), 5 * r, 3 * r)
    assert max_diff(out, ref.decode(latents).sample) < ATOL
    assert out.std() > 0.05 and out.abs().max() <= 1.0        # not flat, clamped like diffusers
    assert (out.abs() < 1.0).float().mean() > 0.5              # mostly unsaturated: compared


@torch.no_grad()
def test_tiled_decode_matches_diffusers(pair: tuple[str, diffusers.AutoencoderKLWan,
                                                    AutoencoderKLWan]) -> None:
    name, ref, ours = pair
    r = FACTOR[name]
    tile, stride = (4 * r, 3 * r), (2 * r, 2 * r)               # latent tiles 4 x 3, stride 2
    ref.enable_tiling(*tile, *stride)
    try:
        latents = torch.randn(1, ours.cfg.z_dim, 2, 6, 5,      # 3 x 3 tiles, 2 latent frames
                              generator=torch.Generator().manual_seed(3))
        out = ours.decode_tiled(latents, tile=tile, stride=stride)
        expected = ref.decode(latents).sample
    finally:
        ref.disable_tiling()
    assert out.shape == (1, 3, 5, 6 * r, 5 * r)
    assert max_diff(out, expected) < ATOL
    assert max_diff(out, ours.decode(latents)) > 1e-3          # tiling really ran
    assert out.abs().max() <= 1.0                              # Wan clamps tiled output too
    small = latents[..., :4, :3]                               # fits one tile: plain decode
    torch.testing.assert_close(ours.decode_tiled(small, tile, stride), ours.decode(small))


@torch.no_grad()
def test_tiled_encode_matches_diffusers(pair: tuple[str, diffusers.AutoencoderKLWan,
                                                    AutoencoderKLWan]) -> None:
    name, ref, ours = pair
    r = FACTOR[name]
    tile, stride = (32, 24), (16, 16)          # diffusers' sizes, in patchified pixels
    videos = torch.rand(1, 3, 5, 6 * r, 5 * r, generator=torch.Generator().manual_seed(4)) * 2 - 1
    ref.enable_tiling(*tile, *stride)
    try:
        expected = ref.encode(videos).latent_dist.mean
    finally:
        ref.disable_tiling()
    mean = ours.encode_tiled(videos, tile=tile, stride=stride)
    assert max_diff(mean, expected) < ATOL
    assert max_diff(mean, ours.encode(videos)) > 1e-4


def test_factors_and_latent_statistics(pair: tuple[str, diffusers.AutoencoderKLWan,
                                                   AutoencoderKLWan]) -> None:
    name, ref, ours = pair
    assert (ours.cfg.downscale, ours.cfg.temporal_downscale) == (FACTOR[name], 4)
    assert ours.cfg.downscale == ref.spatial_compression_ratio
    z_dim = ours.cfg.z_dim
    z = torch.randn(1, z_dim, 1, 2, 2, generator=torch.Generator().manual_seed(5))
    mean = torch.tensor(CONFIGS[name]["latents_mean"]).view(1, z_dim, 1, 1, 1)
    std = torch.tensor(CONFIGS[name]["latents_std"]).view(1, z_dim, 1, 1, 1)
    torch.testing.assert_close(ours.denormalize(z), z * std + mean)
    torch.testing.assert_close(ours.normalize(ours.denormalize(z)), z)


def test_refuses_bad_frames_sizes_and_channels(
        pair: tuple[str, diffusers.AutoencoderKLWan, AutoencoderKLWan]) -> None:
    name, _, ours = pair
    r = FACTOR[name]
    with pytest.raises(ValueError, match=r"6 frames; the encoder takes 1 \+ 4 k"):
        ours.encode(torch.zeros(1, 3, 6, r, r))
    with pytest.raises(ValueError, match=f"{r + 4}x{r}.*spatial factor {r}"):
        ours.encode(torch.zeros(1, 3, 1, r + 4, r))
    with pytest.raises(ValueError, match="1 channels, the VAE takes 3"):
        ours.encode(torch.zeros(1, 1, 1, r, r))
    with pytest.raises(ValueError, match=f"2 channels, the VAE has z_dim={ours.cfg.z_dim}"):
        ours.decode(torch.zeros(1, 2, 1, 2, 2))
    with pytest.raises(ValueError, match=r"latents: expected \(B, C, T, H, W\)"):
        ours.decode_tiled(torch.zeros(1, ours.cfg.z_dim, 4, 4))


@pytest.mark.parametrize("config", [{}, TI2V_5B], ids=["wan2.1", "wan2.2-ti2v-5b"])
def test_published_configs_have_diffusers_tensors(config: dict) -> None:
    """Full-size layouts, built on the meta device: every name and shape as diffusers'."""
    with torch.device("meta"):
        ref = diffusers.AutoencoderKLWan(**config)
        ours = AutoencoderKLWan(AutoencoderKLWanConfig.from_dict(config))
    assert ({k: v.shape for k, v in ours.state_dict().items()}
            == {k: v.shape for k, v in ref.state_dict().items()})
    assert ours.cfg.downscale == ref.spatial_compression_ratio


def test_missing_and_unexpected_tensors_are_named(tmp_path: Path) -> None:
    save_reference("wan22", tmp_path)
    weights = load_file(tmp_path / WEIGHTS)
    del weights["decoder.up_blocks.1.upsampler.time_conv.bias"]
    weights["encoder.down_blocks.0.extra.weight"] = torch.zeros(1)
    save_file(weights, tmp_path / WEIGHTS)
    with pytest.raises(ValueError, match=r"missing tensors: decoder\.up_blocks\.1\.upsampler"
                                         r"\.time_conv\.bias.*unexpected.*down_blocks\.0\.extra"):
        AutoencoderKLWan.from_pretrained(tmp_path)


def test_misshaped_tensor_is_named(tmp_path: Path) -> None:
    save_reference("wan22", tmp_path)
    weights = load_file(tmp_path / WEIGHTS)
    name = "decoder.up_blocks.0.upsampler.resample.1.weight"   # keeps channels in Wan 2.2
    weights[name] = weights[name][: weights[name].shape[0] // 2]
    save_file(weights, tmp_path / WEIGHTS)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        AutoencoderKLWan.from_pretrained(tmp_path)


def test_config_is_checked(tmp_path: Path) -> None:
    save_reference("wan22", tmp_path)
    config = tmp_path / "config.json"
    text = config.read_text()
    config.write_text(text.replace('"scale_factor_spatial": 16', '"scale_factor_spatial": 8'))
    with pytest.raises(ValueError, match="scale_factor_spatial=8, but the network"):
        AutoencoderKLWan.from_pretrained(tmp_path)
    config.write_text(text.replace('"z_dim"', '"z_dims"'))
    with pytest.raises(ValueError, match="unknown keys.*z_dims"):
        AutoencoderKLWan.from_pretrained(tmp_path)
