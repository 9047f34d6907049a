"""Our AutoencoderKLFlux2 against diffusers' on a tiny random checkpoint (its own decoder
widths, random batch-norm statistics): the normalized patches of an encoded image equal
`Flux2KleinPipeline._encode_vae_image`, `denormalize` inverts them and decode matches, in
float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.models.autoencoder_kl_flux2 import AutoencoderKLFlux2

diffusers = pytest.importorskip("diffusers")

TINY = dict(block_out_channels=(8, 16), decoder_block_out_channels=(8, 12), layers_per_block=1,
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=4, norm_num_groups=4, sample_size=32)


@torch.no_grad()
def test_matches_diffusers(tmp_path: Path) -> None:
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
    torch.manual_seed(0)
    ref = diffusers.AutoencoderKLFlux2(**TINY).eval()
    for p in ref.parameters():
        p.normal_(0.0, 0.1)
    ref.bn.running_mean.normal_(0.0, 0.5)
    ref.bn.running_var.uniform_(0.5, 2.0)
    ref.save_pretrained(tmp_path)
    ours = AutoencoderKLFlux2.from_pretrained(tmp_path, "cpu", torch.float32)

    images = torch.rand(2, 3, 32, 24, generator=torch.Generator().manual_seed(1)) * 2 - 1
    pipe = Flux2KleinPipeline(scheduler=None, vae=ref, text_encoder=None, tokenizer=None,
                              transformer=None)
    expected = pipe._encode_vae_image(images, generator=None)            # (B, 4C, h/2, w/2)
    got = ours.normalize(ours.encode(images))
    assert got.shape == (2, 16, 8, 6) and expected.abs().mean() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)

    raw = ours.denormalize(got)
    torch.testing.assert_close(raw, ref.encode(images).latent_dist.mode(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours.decode(raw), ref.decode(raw).sample, atol=1e-5, rtol=1e-4)
