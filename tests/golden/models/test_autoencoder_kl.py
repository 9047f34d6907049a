"""Our AutoencoderKL against diffusers' on a tiny random checkpoint: the same posterior mean,
posterior sample, decode and tiled decode in float32 (SD3-style with quant convs, FLUX-style
without), and loading that fails by name on a mis-shaped tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.models.autoencoder_kl import AutoencoderKL

diffusers = pytest.importorskip("diffusers")

TINY = dict(in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=4, norm_num_groups=4, sample_size=32, scaling_factor=0.3611,
            shift_factor=0.1159)
WEIGHTS = "diffusion_pytorch_model.safetensors"
ATOL, RTOL = 1e-5, 1e-4


def save_reference(path: Path, use_quant_conv: bool) -> diffusers.AutoencoderKL:
    torch.manual_seed(0)
    ref = diffusers.AutoencoderKL(**TINY, use_quant_conv=use_quant_conv,
                                  use_post_quant_conv=use_quant_conv).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.1)
    ref.save_pretrained(path)
    return ref


@pytest.fixture(params=[True, False], ids=["sd3", "flux"])
def pair(request: pytest.FixtureRequest, tmp_path: Path
         ) -> tuple[diffusers.AutoencoderKL, AutoencoderKL]:
    ref = save_reference(tmp_path, use_quant_conv=request.param)
    return ref, AutoencoderKL.from_pretrained(tmp_path)


@torch.no_grad()
def test_encode_decode_match_diffusers(pair: tuple[diffusers.AutoencoderKL, AutoencoderKL]
                                       ) -> None:
    ref, ours = pair
    assert (ours.quant_conv is None) == (not ref.config.use_quant_conv)
    assert ours.cfg.scaling_factor == TINY["scaling_factor"]
    assert ours.cfg.shift_factor == TINY["shift_factor"]
    g = torch.Generator().manual_seed(1)
    images = torch.rand(2, 3, 32, 24, generator=g) * 2 - 1                 # (B, 3, H, W)
    latents = torch.randn(2, 4, 8, 6, generator=g)                         # (B, C, h, w)

    dist = ref.encode(images).latent_dist
    mean = ours.encode(images)
    assert mean.shape == (2, 4, 16, 12)
    torch.testing.assert_close(mean, dist.mean, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours.sample_latents(images, torch.Generator().manual_seed(7)),
                               dist.sample(torch.Generator().manual_seed(7)), atol=ATOL, rtol=RTOL)

    out = ours.decode(latents)
    assert out.shape == (2, 3, 16, 12) and out.isfinite().all()
    torch.testing.assert_close(out, ref.decode(latents).sample, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours.denormalize(ours.normalize(latents)), latents)


@pytest.mark.parametrize("tile, overlap", [(8, 0.25), (4, 0.5)])
@torch.no_grad()
def test_decode_tiled_matches_diffusers(pair: tuple[diffusers.AutoencoderKL, AutoencoderKL],
                                        tile: int, overlap: float) -> None:
    ref, ours = pair
    ref.enable_tiling()
    ref.tile_latent_min_size, ref.tile_sample_min_size = tile, tile * 2
    ref.tile_overlap_factor = overlap
    latents = torch.randn(1, 4, 20, 14, generator=torch.Generator().manual_seed(2))
    out = ours.decode_tiled(latents, tile_size=tile, overlap=overlap)
    expected = ref.decode(latents).sample
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    assert not torch.allclose(out, ours.decode(latents), atol=1e-3)       # tiling really ran
    small = latents[:, :, :tile, :tile]                                    # fits: decodes untiled
    torch.testing.assert_close(ours.decode_tiled(small, tile, overlap), ours.decode(small))


def test_default_tile_follows_sample_size(tmp_path: Path) -> None:
    ref = save_reference(tmp_path, use_quant_conv=False)
    ours = AutoencoderKL.from_pretrained(tmp_path)
    ref.enable_tiling()                                                    # latent tile 16
    latents = torch.randn(1, 4, 28, 20, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours.decode_tiled(latents), ref.decode(latents).sample,
                                   atol=ATOL, rtol=RTOL)


def test_pipelines_decode_whole_images_until_the_pixel_bound(tmp_path: Path) -> None:
    """`decode_images`: images larger than the VAE's sample_size (32 px here) decode whole,
    as diffusers' pipelines do without `enable_tiling()`, a few per call under the bound;
    one image over the bound decodes in sample_size tiles, as diffusers' with tiling on."""
    ref = save_reference(tmp_path, use_quant_conv=False)
    ours = AutoencoderKL.from_pretrained(tmp_path)
    latents = torch.randn(3, 4, 20, 28, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = ref.decode(latents).sample                                 # (3, 3, 40, 56)
        torch.testing.assert_close(ours.decode_images(latents), whole, atol=ATOL, rtol=RTOL)
        calls = []                              # one image's 40x56 px: two a call, then one
        hook = ours.decoder.register_forward_hook(lambda m, i, o: calls.append(o.shape[0]))
        try:
            out = ours.decode_images(latents, max_pixels=2 * 40 * 56 + 1)
        finally:
            hook.remove()
        assert calls == [2, 1]
        torch.testing.assert_close(out, whole, atol=ATOL, rtol=RTOL)
        ref.enable_tiling()                                                # latent tile 16
        torch.testing.assert_close(ours.decode_images(latents, max_pixels=40 * 56 - 1),
                                   ref.decode(latents).sample, atol=ATOL, rtol=RTOL)
        assert not torch.allclose(ref.decode(latents).sample, whole, atol=1e-3)


def test_misshaped_tensor_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path, use_quant_conv=True)
    weights = load_file(tmp_path / WEIGHTS)
    name = "decoder.up_blocks.1.resnets.0.conv1.weight"
    weights[name] = torch.zeros(8, 16, 3, 1)
    save_file(weights, tmp_path / WEIGHTS)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        AutoencoderKL.from_pretrained(tmp_path)


def test_missing_and_unexpected_tensors_are_named(tmp_path: Path) -> None:
    save_reference(tmp_path, use_quant_conv=True)
    weights = load_file(tmp_path / WEIGHTS)
    del weights["encoder.mid_block.attentions.0.to_k.bias"]
    weights["encoder.extra.weight"] = torch.zeros(1)
    save_file(weights, tmp_path / WEIGHTS)
    with pytest.raises(ValueError, match=r"missing tensors: encoder\.mid_block\.attentions\.0"
                                         r"\.to_k\.bias.*unexpected.*encoder\.extra\.weight"):
        AutoencoderKL.from_pretrained(tmp_path)


def test_unknown_config_key_fails(tmp_path: Path) -> None:
    save_reference(tmp_path, use_quant_conv=True)
    config = tmp_path / "config.json"
    config.write_text(config.read_text().replace('"act_fn"', '"act_fnn"'))
    with pytest.raises(ValueError, match="act_fnn"):
        AutoencoderKL.from_pretrained(tmp_path)
