"""HunyuanVideo-1.5 image-to-video: diffusers' `HunyuanVideo15ImageToVideoPipeline.__call__` on
top of the text-to-video pipeline (hunyuan_video15.py), whose encoding, schedule, guidance,
step batching and decode it keeps. What the first frame adds:

    size:       the request's height x width, or (none asked) the resolution bucket of the
                checkpoint's target_size nearest the image's aspect (diffusers' only way);
                the image resized to cover it (Lanczos) and centre-cropped
    image:      SigLIP (image_encoder/ + feature_extractor/) over the cropped image ->
                last_hidden_state (I, image_dim): the transformer's image tokens, for the
                prompt and the negative prompt alike
    condition:  the cropped image -> the VAE's posterior mean -> * scaling_factor on latent
                frame 0, zeros on the others, then the mask channel (1 on frame 0):
                [latents | condition z | mask] along channels, the transformer's input
    MeanFlow:   checkpoints with use_meanflow get timestep_r, the next step's timestep (0 on
                the last step)

A request without an image is refused (its VideoSpec says image-to-video only).
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from torch import Tensor
from transformers import SiglipImageProcessor

from omnistage.diffusion.image_input import input_image
from omnistage.diffusion.pipelines.hunyuan_video15 import (HunyuanVideo15Pipeline,
                                                            bucket_size, make_spec)
from omnistage.diffusion.pipelines.hunyuan_video15_sr import image_bucket
from omnistage.diffusion.request import DiffusionRequest
from omnistage.diffusion_params import DiffusionParams
from omnistage.errors import InputError
from omnistage.models.diffusers_loader import read_config
from omnistage.models.hunyuan_video15_image import (cover_crop, encode_hunyuan_video15_image,
                                                    image_condition, siglip_tokens,
                                                    vae_image_latents)
from omnistage.models.hunyuan_video15_transformer import HunyuanVideo15TransformerConfig
from omnistage.models.siglip_vision import SiglipVisionEncoder
from omnistage.registry import VideoSpec


def video_spec(path: str | Path) -> VideoSpec:
    """What /v1/videos may ask of a HunyuanVideo-1.5 i2v folder: a first frame, always."""
    path = Path(path)
    vae = read_config(path / "vae")
    cfg = HunyuanVideo15TransformerConfig.from_dict(read_config(path / "transformer"))
    return make_spec(vae["spatial_compression_ratio"] * cfg.patch_size,
                     vae["temporal_compression_ratio"], cfg.target_size, fps=24,
                     image_to_video=True)


class HunyuanVideo15ImageToVideoPipeline(HunyuanVideo15Pipeline):
    label = "HunyuanVideo-1.5 I2V"
    image_encoder: SiglipVisionEncoder
    image_processor: SiglipImageProcessor

    @classmethod
    def from_pretrained(cls, path: str | Path, component: str, device: torch.device,
                        dtype: torch.dtype | None, text_encoders: bool = True
                        ) -> HunyuanVideo15ImageToVideoPipeline:
        """The text-to-video parts, and image_encoder/ (float32) + feature_extractor/."""
        pipe = super().from_pretrained(path, component, device, dtype, text_encoders)
        assert isinstance(pipe, cls)
        path = Path(path)
        pipe.image_encoder = SiglipVisionEncoder.from_pretrained(path / "image_encoder", device,
                                                                 torch.float32)
        pipe.image_processor = SiglipImageProcessor.from_pretrained(path / "feature_extractor")
        pipe.video = video_spec(path)
        return pipe

    def validate(self, prompt: str | None, params: DiffusionParams,
                 image: Image.Image | None = None) -> None:
        if image is None and params.image is None:
            raise InputError("image: HunyuanVideo-1.5 image-to-video needs a first frame, "
                             "which the request lacks (/v1/videos: input_reference)", "image")
        if (params.height is None) != (params.width is None):
            raise InputError("height, width: give both or neither (neither: the image's "
                             "bucket)", "height" if params.height is None else "width")
        super().validate(prompt, params, image)

    def _shape_for(self, params: DiffusionParams, image: Image.Image) -> tuple[int, int, int]:
        frames = params.num_frames or self.video.default_num_frames
        if params.height is not None:
            return frames, params.height, params.width
        return frames, *bucket_size(image.height, image.width, self.transformer.cfg.target_size,
                                    self.vae.cfg.downscale)

    @torch.no_grad()
    def prepare_latents(self, params: DiffusionParams, generator: torch.Generator,
                        image: Image.Image | None = None, text: dict[str, Tensor] | None = None
                        ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Text-to-video's noise and schedule at the image's size, plus its SigLIP tokens and
        the first-frame condition (models/hunyuan_video15_image.py)."""
        image = input_image(params, image)
        assert image is not None, "validate refuses a request without an image"
        frames, height, width = self._shape_for(params, image)
        sized = DiffusionParams(height=height, width=width, num_frames=frames,
                                num_inference_steps=params.num_inference_steps,
                                num_images=params.num_images, flow_shift=params.flow_shift)
        inputs = encode_hunyuan_video15_image(self.vae, self.image_encoder,
                                              self.image_processor, image, height, width)
        latents, sigmas, cond = super().prepare_latents(sized, generator, None, text)
        condition, mask = image_condition(inputs.image_latents, 1, latents.shape[2], self.dtype)
        cond["condition"] = torch.cat([condition, mask], dim=1)           # (1, z + 1, F', h, w)
        cond["image_embeds"] = inputs.image_embeds[0].to(self.dtype)      # (I, image_dim)
        return latents, sigmas, cond

    @torch.no_grad()
    def sr_inputs(self, request: DiffusionRequest, shape: tuple[int, ...]
                  ) -> tuple[dict[str, Tensor], Tensor]:
        """The super-resolution pass's first frame, as the upstream SR pipeline encodes it
        again (`cover_crop`, its rounding): the VAE latents of the image at the
        high-resolution size on frame 0 with the mask, and SigLIP tokens of the image cropped
        to the bucket of its own aspect at the SR's resolution (upstream
        `_prepare_vision_states`)."""
        image = input_image(request.params, None)
        assert image is not None, "validate refuses a request without an image"
        assert self.sr is not None, "only the SR pass asks"
        n, _, frames, h, w = shape
        r = self.vae.cfg.downscale
        latents = vae_image_latents(self.vae, cover_crop(image, h * r, w * r))
        condition, mask = image_condition(latents, n, frames, torch.float32)
        vision = cover_crop(image, *image_bucket(image.height, image.width,
                                                 self.sr.recipe.hr_base))
        embeds = siglip_tokens(self.image_encoder, self.image_processor, vision)
        return {"image_embeds": embeds[0][None].expand(n, -1, -1)}, torch.cat([condition, mask],
                                                                              dim=1)

    def extra_inputs(self, rows: list[DiffusionRequest]) -> dict[str, Tensor]:
        out = {"image_embeds": torch.stack([r.cond["image_embeds"] for r in rows])}
        if self.transformer.cfg.use_meanflow:
            nxt = [r.cond["timesteps"][r.step_idx + 1] if r.step_idx + 1 < r.num_steps
                   else r.cond["timesteps"].new_zeros(()) for r in rows]
            out["timestep_r"] = torch.stack(nxt).to(self.device, self.dtype)
        return out
