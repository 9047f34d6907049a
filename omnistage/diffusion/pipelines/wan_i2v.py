"""Wan image-to-video: diffusers' `WanImageToVideoPipeline.__call__` (no last frame) on top of
the text-to-video pipeline (wan.py), whose encode, schedule, experts, guidance, denoising and
decode it keeps. The folders it serves:

    Wan2.1 I2V      one transformer with CLIP image tokens (image_dim): image_encoder/ and
                    image_processor/ beside it
    Wan2.2 I2V-A14B two experts split at boundary_ratio (`transformer/` high noise with
                    guidance_scale, `transformer_2/` low noise with guidance_scale_2), no image
                    encoder: the first frame reaches them through the condition channels only

What the first frame adds:

    image tokens:  (Wan2.1) CLIPImageProcessor (its own resize and center crop of the image as
                   given) -> CLIP vision hidden_states[-2] (1 + patches, image_dim), the same
                   for the prompt and the negative prompt (transformer's
                   encoder_hidden_states_image)
    condition:     the image resized to the request's height x width (Lanczos, as diffusers'
                   VideoProcessor: an image of another aspect is stretched, not cropped),
                   then [image, F-1 black frames] -> the video VAE's posterior mean ->
                   normalized (z, F', h, w); before it the first-frame mask (t, F', h, w): 1 on
                   latent frame 0, 0 elsewhere (t = the VAE's temporal factor)
    each step:     the transformer (either expert) sees [latents | mask | condition] along
                   channels (z + t + z = its in_channels); its output and the latents keep z
                   channels

A request without an image is refused (the VideoSpec says image-to-video only). The image
goes to CLIP in float32, as diffusers' examples load it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor
from transformers import CLIPImageProcessor

from omnistage.diffusion.image_input import input_image, preprocess
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.wan import SPEC, WanPipeline, WanVariant
from omnistage.diffusion.request import DiffusionRequest
from omnistage.models.clip_vision import CLIPVisionEncoder
from omnistage.registry import VideoSpec

SPEC_480P = dataclasses.replace(SPEC, text_to_video=False, image_to_video=True)
SPEC_720P = dataclasses.replace(SPEC_480P, default_size=(1280, 720))


def video_spec(path: str | Path) -> VideoSpec:
    """What /v1/videos may ask of a Wan I2V folder (Wan2.1, Wan2.2 A14B): a first frame, always.
    The 480P and 720P checkpoints share every config; the published folders differ only in name
    (Wan-AI/Wan2.1-I2V-14B-720P-Diffusers, also in its Hub cache path), so a path with "720p"
    defaults to 1280x720, any other to 832x480."""
    return SPEC_720P if "720p" in str(Path(path).resolve()).lower() else SPEC_480P


class WanImageEncoder:
    """CLIP vision and its image processor: `WanImageToVideoPipeline.encode_image`."""

    def __init__(self, encoder: CLIPVisionEncoder, processor: CLIPImageProcessor,
                 device: torch.device) -> None:
        self.encoder = encoder.to(device).eval()
        self.processor = processor
        self.device = device

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device) -> WanImageEncoder:
        path = Path(path)
        encoder = CLIPVisionEncoder.from_pretrained(path / "image_encoder", device,
                                                    torch.float32)
        return cls(encoder, CLIPImageProcessor.from_pretrained(path / "image_processor"),
                   device)

    def encode(self, image: Image.Image) -> Tensor:
        """-> hidden_states[-2] of the image, (1 + patches, image_dim) float32."""
        pixels = self.processor(images=image, return_tensors="pt").pixel_values
        return self.encoder(pixels.to(self.device))[0]


class WanImageToVideoPipeline(WanPipeline):
    label = "Wan I2V"

    image_encoder: WanImageEncoder | None = None    # None: the transformer takes no image tokens

    @classmethod
    def from_pretrained(cls, path: str | Path, component: str, device: torch.device,
                        dtype: torch.dtype | None, text_encoders: bool = True
                        ) -> WanImageToVideoPipeline:
        """A diffusers WanImageToVideoPipeline folder: the text-to-video parts (with Wan2.2
        I2V-A14B's second expert), and image_encoder/ + image_processor/ where the transformer
        has image_dim."""
        if WanVariant.read(path).expand_timesteps:
            raise ValueError(f"{path}: model_index.json expand_timesteps (Wan2.2 TI2V's "
                             "first-frame latents) in an image-to-video folder: TI2V is served "
                             "from its WanPipeline folder, which takes a first image")
        pipe = super().from_pretrained(path, component, device, dtype, text_encoders)
        assert isinstance(pipe, cls)
        if pipe.transformer.cfg.image_dim is not None:
            pipe.image_encoder = WanImageEncoder.from_pretrained(path, device)
        pipe.video = video_spec(path)
        return pipe

    @torch.no_grad()
    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator,
                image: Image.Image | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Text-to-video's prompt, noise and schedule, plus the first frame's conditioning
        ("condition", and "image_embeds" with an image encoder)."""
        latents, sigmas, cond = super().prepare(prompt, params, generator, image)
        image = input_image(params, image)
        assert image is not None, "validate refuses a request without an image"
        frames, height, width = self._shape(params)
        cond["condition"] = self.condition(image, frames, height, width).to(self.dtype)
        if self.image_encoder is not None:
            cond["image_embeds"] = self.image_encoder.encode(image).to(self.dtype)
        return latents, sigmas, cond

    def condition(self, image: Image.Image, frames: int, height: int, width: int) -> Tensor:
        """[first-frame mask | normalized latents of the image then black frames], (1, t + z,
        F', h, w) float32: `WanImageToVideoPipeline.prepare_latents`."""
        pixels = preprocess(image, height, width).to(self.device)          # (1, 3, H, W)
        black = pixels.new_zeros(1, 3, frames - 1, height, width)
        video = torch.cat([pixels.unsqueeze(2), black], dim=2)              # (1, 3, F, H, W)
        latents = self.vae.normalize(self.vae.encode(video))                # (1, z, F', h, w)
        t = self.vae.cfg.temporal_downscale
        mask = latents.new_zeros(1, t, *latents.shape[2:])
        mask[:, :, 0] = 1.0                          # the t pixel frames of latent frame 0
        return torch.cat([mask, latents], dim=1)

    def model_inputs(self, x: Tensor, rows: list[DiffusionRequest]
                     ) -> tuple[Tensor, Tensor | None]:
        """[x | each row's condition] (R, z + t + z, F', h, w), and its image tokens."""
        x = torch.cat([x, torch.cat([r.cond["condition"] for r in rows]).to(x.dtype)], dim=1)
        if self.image_encoder is None:
            return x, None
        return x, torch.stack([r.cond["image_embeds"] for r in rows])
