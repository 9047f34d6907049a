"""HunyuanVideo-1.5 image-to-video's image side (diffusers' `HunyuanVideo15ImageToVideoPipeline`:
the resize in `__call__`, `encode_image`, `_get_image_latents`, `prepare_cond_latents_and_mask`).

    image (PIL) -> crop_resize to the bucket (height, width): cover it keeping the aspect
                   ratio (Lanczos), centre crop
       -> SigLIP processor (its own resize, [-1, 1]) -> SigLIP last_hidden_state -> image_embeds
       -> [0, 255] -> [-1, 1] -> VAE posterior mean * scaling_factor   -> image_latents
    image_latents -> condition: frame 0 = the image's latents, later frames 0   (B, z, T', h, w)
                     mask:      1 on frame 0, 0 after                          (B, 1, T', h, w)

The transformer takes [noisy latents | condition | mask] on its channels, and the image tokens
beside the text (text-to-video passes zeros for both and zero image tokens).

The super-resolution pass (upstream repository, not diffusers) crops with `cover_crop`, whose
sides and offsets round where diffusers' `crop_resize` floors, and crops the SigLIP input to
its own bucket (`siglip_tokens` and `vae_image_latents` take an image already cropped).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from transformers import BaseImageProcessor

from omnistage.models.autoencoder_kl_hunyuan_video15 import AutoencoderKLHunyuanVideo15
from omnistage.models.siglip_vision import SiglipVisionEncoder


class HunyuanVideo15ImageInputs(NamedTuple):
    image_embeds: Tensor     # (1, N, D) SigLIP tokens (N = 729, D = 1152 for the real encoder)
    image_latents: Tensor    # (1, z, 1, height / r, width / r), times the VAE's scaling factor


def crop_resize(image: Image.Image, height: int, width: int) -> Image.Image:
    """`VaeImageProcessor.resize(image, height, width, resize_mode="crop")`: scaled (Lanczos)
    to cover height x width with its aspect ratio kept, then centred on an RGB canvas of that
    size, the excess cut."""
    ratio, src_ratio = width / height, image.width / image.height
    src_w = width if ratio > src_ratio else image.width * height // image.height
    src_h = height if ratio <= src_ratio else image.height * width // image.width
    resized = image.resize((src_w, src_h), resample=Image.Resampling.LANCZOS)
    canvas = Image.new("RGB", (width, height))
    canvas.paste(resized, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
    return canvas


def cover_crop(image: Image.Image, height: int, width: int) -> Image.Image:
    """The upstream repository's crop (its SR pass's torchvision Resize + CenterCrop and its
    `resize_and_center_crop`): scaled (Lanczos) by s = max(width / W, height / H) to
    round(W s) x round(H s), then cut at round((W' - width) / 2), round((H' - height) / 2)."""
    scale = max(width / image.width, height / image.height)
    size = int(round(image.width * scale)), int(round(image.height * scale))
    resized = image.resize(size, resample=Image.Resampling.LANCZOS)
    left, top = (int(round((n - c) / 2.0)) for n, c in zip(size, (width, height)))
    return resized.crop((left, top, left + width, top + height))


def vae_pixels(image: Image.Image) -> Tensor:
    """An RGB image, already at its size -> (1, 3, H, W) float32 in [-1, 1] (the i2v
    processor's `preprocess`, which does not resize)."""
    array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0          # (H, W, 3)
    return torch.from_numpy(array).permute(2, 0, 1)[None] * 2.0 - 1.0


@torch.inference_mode()
def encode_hunyuan_video15_image(vae: AutoencoderKLHunyuanVideo15,
                                 image_encoder: SiglipVisionEncoder,
                                 image_processor: BaseImageProcessor, image: Image.Image,
                                 height: int, width: int) -> HunyuanVideo15ImageInputs:
    """The request's image, cropped and resized to (height, width) here, -> its SigLIP tokens
    and its first-frame latents (each in its model's dtype, on its device)."""
    image = crop_resize(image, height, width)
    return HunyuanVideo15ImageInputs(siglip_tokens(image_encoder, image_processor, image),
                                     vae_image_latents(vae, image))


@torch.inference_mode()
def siglip_tokens(image_encoder: SiglipVisionEncoder, image_processor: BaseImageProcessor,
                  image: Image.Image) -> Tensor:
    """An image, already cropped, -> its SigLIP tokens (1, N, D) (the processor resizes)."""
    weight = image_encoder.embeddings.patch_embedding.weight
    pixel_values = image_processor.preprocess(images=image, do_resize=True, return_tensors="pt",
                                              do_convert_rgb=True)["pixel_values"]
    return image_encoder(pixel_values.to(weight.device, weight.dtype))


@torch.inference_mode()
def vae_image_latents(vae: AutoencoderKLHunyuanVideo15, image: Image.Image) -> Tensor:
    """An image, already at its size, -> its first-frame latents (1, z, 1, h, w)."""
    vae_weight = next(vae.parameters())
    pixels = vae_pixels(image).to(vae_weight.device, vae_weight.dtype)
    return vae.normalize(vae.encode(pixels.unsqueeze(2)))


def image_condition(image_latents: Tensor, batch: int, num_latent_frames: int,
                    dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """image_latents (1, z, 1, h, w) -> the condition (batch, z, T', h, w): the image's latents
    on frame 0 and zeros after, and the mask (batch, 1, T', h, w): 1 on frame 0."""
    _, z, _, h, w = image_latents.shape
    condition = image_latents.new_zeros(batch, z, num_latent_frames, h, w, dtype=dtype)
    condition[:, :, :1] = image_latents.to(dtype)
    mask = image_latents.new_zeros(batch, 1, num_latent_frames, h, w, dtype=dtype)
    mask[:, :, 0] = 1.0
    return condition, mask
