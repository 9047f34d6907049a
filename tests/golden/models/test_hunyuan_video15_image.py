"""HunyuanVideo-1.5 image-to-video's image side (hunyuan_video15_image.py on our VAE and SigLIP
encoder) against diffusers' HunyuanVideo15ImageToVideoPipeline on tiny random parts, float32:
the crop-resize of `__call__`, `encode_image` (SigLIP tokens), `prepare_cond_latents_and_mask`
(the first frame's scaled posterior mean, the frame mask) for a batch of 2, two image shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import SiglipImageProcessor

from omnistage.models.autoencoder_kl_hunyuan_video15 import AutoencoderKLHunyuanVideo15
from omnistage.models.hunyuan_video15_image import (crop_resize, encode_hunyuan_video15_image,
                                                    image_condition)
from omnistage.models.siglip_vision import SiglipVisionEncoder
from tests.helpers.hunyuan_video15_parts import (LATENT_CHANNELS, TINY_SIGLIP, build_tiny_siglip,
                                                 build_tiny_vae)

diffusers = pytest.importorskip("diffusers")

HEIGHT, WIDTH = 40, 24          # 5 x 3 latents at the tiny VAE's 8x
ATOL = 1e-5


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, dict[str, object]]:
    path = tmp_path_factory.mktemp("hv15_image")
    vae = build_tiny_vae(path / "vae")
    siglip = build_tiny_siglip(path / "image_encoder")
    size = TINY_SIGLIP["image_size"]
    SiglipImageProcessor(size={"height": size, "width": size}).save_pretrained(
        path / "feature_extractor")
    processor = SiglipImageProcessor.from_pretrained(path / "feature_extractor")
    ref = diffusers.HunyuanVideo15ImageToVideoPipeline(
        text_encoder=None, tokenizer=None, transformer=None, vae=vae,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), text_encoder_2=None,
        tokenizer_2=None, guider=diffusers.ClassifierFreeGuidance(), image_encoder=siglip,
        feature_extractor=processor)
    ours = dict(vae=AutoencoderKLHunyuanVideo15.from_pretrained(path / "vae"),
                image_encoder=SiglipVisionEncoder.from_pretrained(path / "image_encoder"),
                image_processor=SiglipImageProcessor.from_pretrained(path / "feature_extractor"))
    return ref, ours


def random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    smooth = rng.integers(0, 256, (height // 4 + 1, width // 4 + 1, 3), dtype=np.uint8)
    return Image.fromarray(smooth).resize((width, height), Image.Resampling.BICUBIC)


@pytest.mark.parametrize("size", [(53, 29), (20, 47)], ids=["wide", "tall"])
@torch.no_grad()
def test_image_side_matches_diffusers(parts: tuple[object, dict[str, object]],
                                      size: tuple[int, int]) -> None:
    ref, ours = parts
    image = random_image(*size, seed=size[0])
    resized = ref.video_processor.resize(image, height=HEIGHT, width=WIDTH, resize_mode="crop")
    assert np.array_equal(np.asarray(crop_resize(image, HEIGHT, WIDTH)), np.asarray(resized))

    got = encode_hunyuan_video15_image(image=image, height=HEIGHT, width=WIDTH, **ours)
    embeds = ref.encode_image(resized, batch_size=1, device=torch.device("cpu"),
                              dtype=torch.float32)
    assert got.image_embeds.shape == embeds.shape and embeds.std() > 0.3
    assert (got.image_embeds - embeds).abs().max() < ATOL

    latents = torch.zeros(2, LATENT_CHANNELS, 3, HEIGHT // 8, WIDTH // 8)
    cond, mask = ref.prepare_cond_latents_and_mask(
        latents=latents, image=resized, batch_size=2, height=HEIGHT, width=WIDTH,
        dtype=torch.float32, device=torch.device("cpu"))
    ours_cond, ours_mask = image_condition(got.image_latents, 2, 3, torch.float32)
    assert cond[:, :, 0].std() > 0.1                             # the image, at a real scale
    assert ours_cond.shape == cond.shape and (ours_cond - cond).abs().max() < ATOL
    assert torch.equal(ours_mask, mask)
    assert torch.equal(got.image_latents, ours["vae"].normalize(ours["vae"].encode(
        (torch.from_numpy(np.asarray(resized, dtype=np.float32) / 255.0).permute(2, 0, 1)[None]
         * 2.0 - 1.0).unsqueeze(2))))


def test_condition_dtype_and_zeros() -> None:
    latents = torch.randn(1, LATENT_CHANNELS, 1, 2, 3)
    cond, mask = image_condition(latents, 3, 4, torch.bfloat16)
    assert cond.dtype == mask.dtype == torch.bfloat16 and cond.shape == (3, LATENT_CHANNELS, 4, 2, 3)
    assert cond[:, :, 1:].abs().max() == 0 and mask.sum() == 3 * 2 * 3
