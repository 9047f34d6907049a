"""FLUX.1 text-to-image (dev / schnell): diffusers' `FluxPipeline.__call__` split into the
engine's phases (omnistage/diffusion/pipeline.py), numerics kept step for step.

    encode:   CLIP pooled (77 tokens) + T5 sequence (max_sequence_length tokens), every prompt
              of a batch of requests in one call of each encoder (FluxPromptEncoder)
    prepare:  randn (n, C, 2*(H//16), 2*(W//16)) on the request's CPU generator -> pack 2x2
              sigmas linspace(1, 1/N, N) shifted by mu(image_seq_len)
    velocity: one transformer forward over all rows; timestep = (sigma * 1000) / 1000 as
              diffusers feeds it; distilled guidance embedding per row (FLUX.1-dev)
    decode:   unpack -> z / scaling + shift -> VAE (each image whole, as diffusers' pipeline;
              in tiles only above 2048 x 2048 px: AutoencoderKL.decode_images) ->
              (x/2 + 0.5).clamp(0, 1) -> uint8

Every network is ours (CLIP and T5 text encoders, transformer, VAE); tokenizers come from
transformers. The text encoders may run in a stage of their own (configs/flux_split.yaml; see
diffusion/pipeline.py).
No true CFG (negative prompt) yet. Step caching per request (TeaCache's FLUX polynomial).
Splits by tensor and sequence parallelism (in the transformer); CFG-parallel has no branches
to split here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from torch import Tensor
from transformers import AutoTokenizer

from omnistage.layers.step_cache import cache_groups
from omnistage.diffusion.image_input import image_to_image, noised_image
from omnistage.diffusion.latent_pipeline import LatentPipelineBase
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipeline import check_conditioning, forward_by_key
from omnistage.diffusion.request import DiffusionRequest
from omnistage.models.autoencoder_kl import AutoencoderKL
from omnistage.models.flux_transformer import FluxTransformer2DModel
from omnistage.models.text_encoders import CLIPTextEncoder, T5Encoder

MAX_SIZE = 2048
DEFAULT_GUIDANCE = 3.5              # FLUX.1-dev's distilled guidance, as in diffusers
MAX_SEQUENCE_LENGTH = 512           # T5 tokens, diffusers' default and maximum
CLIP_MAX_LENGTH = 77


def check_text_params(prompt: str | None, params: DiffusionParams) -> None:
    """The request's text and guidance fields (prompt None: encoded upstream, not checked)."""
    if prompt is not None and not prompt.strip():
        raise ValueError("prompt: must be non-empty")
    if params.negative_prompt is not None or params.true_cfg_scale != 1.0:
        raise ValueError("negative_prompt / true_cfg_scale: true CFG is not supported by the "
                         "FLUX pipeline yet (use guidance_scale, the distilled guidance)")


class FluxPromptEncoder:
    """CLIP (pooled) and T5 (sequence): the text part of `FluxPipeline.prepare`, batched over
    requests."""

    def __init__(self, text_encoder: CLIPTextEncoder, tokenizer, text_encoder_2: T5Encoder,
                 tokenizer_2, device: torch.device,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> None:
        if not 1 <= max_sequence_length <= MAX_SEQUENCE_LENGTH:
            raise ValueError(f"max_sequence_length={max_sequence_length}: must be in "
                             f"[1, {MAX_SEQUENCE_LENGTH}]")
        self.text_encoder = text_encoder.to(device).eval()
        self.text_encoder_2 = text_encoder_2.to(device).eval()
        self.tokenizer, self.tokenizer_2 = tokenizer, tokenizer_2
        self.device = device
        self.max_sequence_length = max_sequence_length
        # diffusers: tokenizer.model_max_length (77 for CLIP)
        self.clip_max_length = min(tokenizer.model_max_length,
                                   text_encoder.config.max_position_embeddings)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device,
                        dtype: torch.dtype | None) -> FluxPromptEncoder:
        """The pipeline folder's text_encoder*/ (in `dtype`; None: their own) and tokenizers."""
        path = Path(path)
        return cls(CLIPTextEncoder.from_pretrained(path / "text_encoder", device, dtype),
                   AutoTokenizer.from_pretrained(path / "tokenizer"),
                   T5Encoder.from_pretrained(path / "text_encoder_2", device, dtype),
                   AutoTokenizer.from_pretrained(path / "tokenizer_2"), device)

    def validate(self, prompt: str, params: DiffusionParams) -> None:
        check_text_params(prompt, params)

    @torch.inference_mode()
    def encode(self, prompts: list[str], params: list[DiffusionParams]
               ) -> list[dict[str, Tensor]]:
        """Per request: prompt_embeds, the T5 sequence (1, max_sequence_length, joint_dim), and
        pooled, CLIP's pooled output (1, pooled_dim)."""
        assert len(prompts) == len(params), (len(prompts), len(params))
        clip_ids = self.tokenizer(prompts, padding="max_length", max_length=self.clip_max_length,
                                  truncation=True, return_tensors="pt").input_ids
        _, pooled = self.text_encoder(clip_ids.to(self.device))            # (B, P)
        t5_ids = self.tokenizer_2(prompts, padding="max_length",
                                  max_length=self.max_sequence_length, truncation=True,
                                  return_tensors="pt").input_ids
        embeds = self.text_encoder_2(t5_ids.to(self.device))                # (B, T, J)
        return [{"prompt_embeds": e[None], "pooled": p[None]} for e, p in zip(embeds, pooled)]


class FluxPipeline(LatentPipelineBase):
    label = "FLUX"
    transformer_cls = FluxTransformer2DModel
    vae_cls = AutoencoderKL
    prompt_encoder_cls = FluxPromptEncoder
    max_size = MAX_SIZE
    check_text_params = staticmethod(check_text_params)
    parallel_axes = ("ulysses", "ring", "tp")       # no true CFG: no branches to split
    graphable = True

    # ---- 1. prepare (encode: the base class) ---------------------------------------------

    def check_conditioning(self, tensors: dict[str, Tensor], params: DiffusionParams
                           ) -> dict[str, Tensor]:
        """prompt_embeds (1, T, joint_dim) and pooled (1, pooled_dim)."""
        cfg = self.transformer.cfg
        return check_conditioning(tensors, {"prompt_embeds": (3, cfg.joint_attention_dim),
                                            "pooled": (2, cfg.pooled_projection_dim)},
                                  self.device, self.dtype)

    def prepare_latents(self, params: DiffusionParams, generator: torch.Generator,
                        image: Image.Image | None = None
                        ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """-> packed latents (n, N, 4C), sigmas, {"grid": packed token grid (2,)}."""
        n = params.num_images
        # timesteps: FLUX's custom sigmas, shifted by the number of image tokens
        height, width, h, w, sigmas = self.latent_schedule(params, image=image)

        # prepare_latents: noise in latent space (image-to-image: the encoded image noised to
        # the first sigma of the strength-shortened schedule), then 2x2 patches packed
        image_latents = None
        img2img = image_to_image(params, sigmas, height, width, image)
        if img2img is not None:             # FluxImg2ImgPipeline: encode draws first, then noise
            sigmas, image = img2img
            image_latents = self.vae.normalize(self.vae.sample_latents(
                image.to(self.device, self.dtype), generator))              # (1, C, h, w)
        c = self.num_channels_latents
        noise = torch.randn((n, c, h, w), generator=generator, device=generator.device,
                            dtype=self.dtype).to(self.device)               # (n, C, h, w)
        if image_latents is not None:
            noise = noised_image(image_latents, sigmas[0], noise)
        latents = pack_latents(noise)                                        # (n, h/2*w/2, 4C)
        return latents, sigmas, {"grid": torch.tensor([h // 2, w // 2])}   # packed token grid

    # ---- 2. velocity -----------------------------------------------------------------------

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """latents (R, N, 4C) -> (R, N, 4C). One forward per latent grid: sizes such as 32x64
        and 64x32 pack to the same N (one engine batch) but need different image rope ids."""
        return forward_by_key(latents, sigmas, requests,
                              lambda r: tuple(r.cond["grid"].tolist()), self._forward)

    def _forward(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """Requests on one latent grid, all their images in one transformer call."""
        counts = [r.latents.shape[0] for r in requests]
        embeds = torch.cat([r.cond["prompt_embeds"].expand(n, -1, -1)
                            for r, n in zip(requests, counts)])              # (R, T, J)
        pooled = torch.cat([r.cond["pooled"].expand(n, -1)
                            for r, n in zip(requests, counts)])              # (R, P)
        guidance = None
        if self.transformer.cfg.guidance_embeds:                             # FLUX.1-dev
            guidance = torch.cat([torch.full((n,), r.params.guidance(DEFAULT_GUIDANCE),
                                             dtype=torch.float32)
                                  for r, n in zip(requests, counts)]).to(self.device)
        # diffusers feeds timesteps = sigmas * 1000 and divides by 1000 at the call
        timestep = (sigmas * self.scheduler.num_train_timesteps).to(latents.dtype) / 1000
        h, w = requests[0].cond["grid"].tolist()
        img_ids = latent_image_ids(h, w).to(self.device, self.dtype)        # (N, 3)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype)
        step_cache = None
        if any(r.params.cache_threshold is not None for r in requests):
            step_cache = cache_groups(requests, counts, [("cond", [True] * len(requests))])
        return self.run_transformer(latents, embeds, pooled, timestep, img_ids=img_ids,
                                    txt_ids=txt_ids, guidance=guidance, step_cache=step_cache)

    # ---- 3. decode -------------------------------------------------------------------------

    def decode_float(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        """packed latents (n, N, 4C) -> float32 images (n, 3, H, W) in [0, 1], what diffusers
        returns for output_type="pt" (before the quantization of `decode`)."""
        height, width = self._size(params)
        h, w = 2 * (height // self.multiple), 2 * (width // self.multiple)
        z = self.vae.denormalize(unpack_latents(latents, h, w))             # (n, C, h, w)
        images = self.vae.decode_images(z.to(self.device))   # (n, 3, H, W); tiles if huge
        return (images / 2 + 0.5).clamp(0, 1).float()



# ---- latent layout (diffusers' FluxPipeline static methods) ----------------------------------

def pack_latents(latents: Tensor) -> Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): each 2x2 patch becomes one token (c, dy, dx)."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: Tensor, h: int, w: int) -> Tensor:
    """(B, h/2 * w/2, 4C) -> (B, C, h, w), the inverse of `pack_latents`."""
    b, _, ch = latents.shape
    latents = latents.view(b, h // 2, w // 2, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, ch // 4, h, w)


def latent_image_ids(h: int, w: int) -> Tensor:
    """(h*w, 3) rope positions of the packed tokens: (0, row, col)."""
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(h)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)
