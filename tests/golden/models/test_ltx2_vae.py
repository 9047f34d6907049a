"""Our AutoencoderKLLTX2Video against diffusers' on tiny random checkpoints in float32: LTX-2's
shape (causal decoder, reflect padding, spatial then temporal downsampling) and a
timestep-conditioned, noise-injecting, non-causal one. Decode of 1 and 3 latent frames at an
odd size (batch 2, two timesteps), encode (mean and logvar) of 1 and 1 + 2 rt frames, tiled
decode against `enable_tiling`, the diffusion-space statistics against LTX2Pipeline's, the
frame/size/timestep rules, and strict loading."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.models.autoencoder_kl_ltx2 import AutoencoderKLLTX2Video
from tests.helpers.ltx2_vae import VIDEO_CONFIGS, VIDEO_RATIOS, save_video_vae

diffusers = pytest.importorskip("diffusers")

WEIGHTS = "diffusion_pytorch_model.safetensors"
ATOL = 1e-5                                   # frames in [-1, 1]: far inside 2/255


@pytest.fixture(scope="module", params=sorted(VIDEO_CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[str, torch.nn.Module, AutoencoderKLLTX2Video, Path]:
    path = tmp_path_factory.mktemp(request.param)
    ref = save_video_vae(request.param, path)
    return request.param, ref, AutoencoderKLLTX2Video.from_pretrained(path), path


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _timestep(ours: AutoencoderKLLTX2Video) -> torch.Tensor | None:
    return torch.tensor([0.05, 0.4]) if ours.cfg.timestep_conditioning else None


@pytest.mark.parametrize("frames", [1, 3])
@torch.no_grad()
def test_decode_matches_diffusers(pair: tuple, frames: int) -> None:
    name, ref, ours, _ = pair
    r, rt = VIDEO_RATIOS[name]
    latents = torch.randn(2, 8, frames, 3, 5, generator=torch.Generator().manual_seed(2))
    t = _timestep(ours)
    torch.manual_seed(11)                    # injected noise: the same global draws
    expected = ref.decode(latents, t).sample
    torch.manual_seed(11)
    out = ours.decode(latents, t)
    assert out.shape == (2, 3, 1 + rt * (frames - 1), 3 * r, 5 * r)
    assert out.std() > 0.1                   # a scale the tolerance means
    assert max_diff(out, expected) < ATOL
    assert max_diff(out[0], out[1]) > 1e-2   # the batch rows differ (latents, timesteps)


@torch.no_grad()
def test_a_plausible_bug_fails(pair: tuple) -> None:
    """The comparison can tell: the other causality, or the timestep ignored, changes frames."""
    _, ref, ours, path = pair
    latents = torch.randn(2, 8, 2, 3, 5, generator=torch.Generator().manual_seed(5))
    t = _timestep(ours)
    torch.manual_seed(3)
    expected = ref.decode(latents, t).sample
    flipped = AutoencoderKLLTX2Video.from_pretrained(path)
    flipped.cfg = dataclasses.replace(ours.cfg, decoder_causal=not ours.cfg.decoder_causal)
    torch.manual_seed(3)
    assert max_diff(flipped.decode(latents, t), expected) > 1e-2
    if t is not None:
        torch.manual_seed(3)
        assert max_diff(ours.decode(latents, t.flip(0)), expected) > 1e-2


@pytest.mark.parametrize("lengths", [0, 2])
@torch.no_grad()
def test_encode_matches_diffusers(pair: tuple, lengths: int) -> None:
    name, ref, ours, _ = pair
    r, rt = VIDEO_RATIOS[name]
    frames = 1 + lengths * rt
    videos = torch.rand(2, 3, frames, 3 * r, 5 * r, generator=torch.Generator().manual_seed(1))
    dist = ref.encode(videos * 2 - 1).latent_dist
    mean, logvar = ours.moments(videos * 2 - 1)
    assert mean.shape == (2, 8, 1 + lengths, 3, 5)
    assert dist.mean.std() > 0.1
    assert max_diff(mean, dist.mean) < ATOL
    assert max_diff(logvar, dist.logvar) < ATOL
    assert max_diff(ours.encode(videos * 2 - 1), dist.mode()) < ATOL


@torch.no_grad()
def test_tiled_decode_matches_diffusers(pair: tuple) -> None:
    name, ref, ours, _ = pair
    r, rt = VIDEO_RATIOS[name]
    tile, stride = (4 * r, 4 * r), (3 * r, 3 * r)       # latent tiles 4 x 4, 2 x 2 of them
    latents = torch.randn(2, 8, 2, 5, 6, generator=torch.Generator().manual_seed(3))
    t = _timestep(ours)
    ref.enable_tiling(tile_sample_min_height=tile[0], tile_sample_min_width=tile[1],
                      tile_sample_stride_height=stride[0], tile_sample_stride_width=stride[1])
    try:
        torch.manual_seed(4)
        expected = ref.decode(latents, t).sample
    finally:
        ref.disable_tiling()
    torch.manual_seed(4)
    out = ours.decode_tiled(latents, t, tile=tile, stride=stride)
    assert out.shape == (2, 3, 1 + rt, 5 * r, 6 * r)
    assert max_diff(out, expected) < ATOL
    if not ours.cfg.timestep_conditioning:                     # no noise: compare untiled
        assert max_diff(out, ours.decode(latents)) > 1e-3      # tiling really ran


def test_latent_statistics_match_the_pipeline(pair: tuple) -> None:
    from diffusers import LTX2Pipeline
    _, ref, ours, _ = pair
    latents = torch.randn(2, 8, 2, 3, 5)
    expected = LTX2Pipeline._normalize_latents(latents, ref.latents_mean, ref.latents_std,
                                               ref.config.scaling_factor)
    assert max_diff(ours.normalize(latents), expected) < 1e-6
    back = LTX2Pipeline._denormalize_latents(expected, ref.latents_mean, ref.latents_std,
                                             ref.config.scaling_factor)
    assert max_diff(ours.denormalize(expected), back) < 1e-6
    assert (ours.cfg.spatial_ratio, ours.cfg.temporal_ratio) == (
        ref.spatial_compression_ratio, ref.temporal_compression_ratio)


def test_bad_shapes_name_the_field(pair: tuple) -> None:
    name, _, ours, _ = pair
    r, rt = VIDEO_RATIOS[name]
    with pytest.raises(ValueError, match="frames"):
        ours.encode(torch.zeros(1, 3, 2 + rt, r, r))
    with pytest.raises(ValueError, match="multiples"):
        ours.encode(torch.zeros(1, 3, 1, r + 2, r))
    with pytest.raises(ValueError, match="channels"):
        ours.decode(torch.zeros(1, 7, 1, 2, 2))
    if ours.cfg.timestep_conditioning:
        with pytest.raises(ValueError, match="timestep"):
            ours.decode(torch.zeros(2, 8, 1, 2, 2))


def test_strict_loading(pair: tuple, tmp_path: Path) -> None:
    _, _, _, path = pair
    tensors = load_file(path / WEIGHTS)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    missing = dict(tensors)
    missing.pop("decoder.conv_out.conv.weight")
    save_file(missing, tmp_path / WEIGHTS)
    with pytest.raises(ValueError, match="decoder.conv_out.conv.weight"):
        AutoencoderKLLTX2Video.from_pretrained(tmp_path)
    save_file({**tensors, "decoder.extra.weight": torch.zeros(1)}, tmp_path / WEIGHTS)
    with pytest.raises(ValueError, match="decoder.extra.weight"):
        AutoencoderKLLTX2Video.from_pretrained(tmp_path)
