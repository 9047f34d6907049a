"""FLUX.2 text-to-image and multi-reference editing: diffusers' `Flux2KleinPipeline.__call__`
(klein: Qwen3 text encoder, true CFG unless step-distilled) and `Flux2Pipeline.__call__` (dev:
Mistral-3 text encoder, distilled guidance) split into the engine's phases
(omnistage/diffusion/pipeline.py), numerics kept step for step.

    encode:   chat template -> text encoder, padded to max_sequence_length -> hidden states of
              several layers (klein 9, 18, 27; dev 10, 20, 30) side by side: (1, S, 3*hidden)
              per prompt; klein with CFG also the negative prompt ("" by default); all prompts
              of a batch of requests in one call
    prepare:  randn (n, 4C, H//16, W//16) in the model dtype on the request's CPU generator
              (2x2 patches of the C-channel latent) -> tokens (n, N, 4C)
              sigmas linspace(1, 1/N, N) shifted by FLUX.2's empirical mu(N tokens, steps)
              reference images: each capped to 1024^2 pixels, cropped to a multiple of 16,
              VAE-encoded (posterior mode), batch-normalized patches -> tokens with position
              ids (10 * (i + 1), row, col, 0), appended after the latent tokens
    velocity: one transformer call over all rows (and klein's negative rows); the latent
              tokens' output only; dev: guidance scale -> the guidance embedding; klein CFG:
              neg + g * (pos - neg)
    decode:   tokens -> patches -> * std + mean -> unpatchify -> VAE (each image whole, as
              diffusers' pipeline; tiles only above 2048 x 2048 px) -> (x/2 + 0.5).clamp(0, 1)

Every network is ours (text encoder, transformer, VAE); tokenizers come from transformers
(the text side: flux2_text.py).
Step caching per request and CFG branch (identity rescaling). Runs on one rank (no parallel
axis); the text encoder runs in the diffusion stage.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from omnistage.diffusion.image_input import input_images, opened_images, peek_image, preprocess
from omnistage.diffusion.params import MAX_INPUT_IMAGES, DiffusionParams
from omnistage.diffusion.latent_pipeline import LatentPipelineBase
from omnistage.diffusion.cfg import GuidedRows
from omnistage.diffusion.pipeline import check_conditioning, forward_by_key
from omnistage.diffusion.pipelines.flux2_text import (DEFAULT_GUIDANCE, Flux2KleinPromptEncoder,
                                                      Flux2PromptEncoder, check_text_params,
                                                      has_cfg, is_distilled)
from omnistage.diffusion.request import DiffusionRequest
from omnistage.diffusion.solvers import flow_match_euler as solver
from omnistage.layers.step_cache import cache_groups
from omnistage.models.autoencoder_kl_flux2 import AutoencoderKLFlux2
from omnistage.models.flux2_transformer import Flux2Transformer2DModel

MAX_SIZE = 2048
REFERENCE_AREA = 1024 * 1024        # a larger reference image is scaled down to this area
REFERENCE_MIN_SIDE = 64             # Flux2ImageProcessor.check_image_input's limits
REFERENCE_MAX_ASPECT = 8
REFERENCE_TIME_SCALE = 10           # reference i gets time position 10 * (i + 1)


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's schedule shift: fitted on image tokens and steps (diffusers, from BFL's
    sampling.py), linear in the token count past 4300 tokens."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * num_steps + m_200 - 200.0 * a)


def check_reference(image: Image.Image, idx: int) -> None:
    """diffusers' `check_image_input`: both sides >= 64 px, aspect ratio at most 8."""
    width, height = image.size
    if min(width, height) < REFERENCE_MIN_SIDE:
        raise ValueError(f"image[{idx}]: {width}x{height} is too small; both sides must be at "
                         f"least {REFERENCE_MIN_SIDE} px")
    if max(width / height, height / width) > REFERENCE_MAX_ASPECT:
        raise ValueError(f"image[{idx}]: {width}x{height} has an aspect ratio beyond "
                         f"{REFERENCE_MAX_ASPECT}:1")


def capped_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) of a reference image scaled down to 1024^2 pixels when larger (int()
    of the scaled sides, as `_resize_to_target_area`)."""
    if width * height <= REFERENCE_AREA:
        return width, height
    scale = math.sqrt(REFERENCE_AREA / (width * height))
    return int(width * scale), int(height * scale)


def reference_size(width: int, height: int, multiple: int) -> tuple[int, int]:
    """(height, width) a reference image is encoded at: `capped_size`, each side floored to
    `multiple`."""
    width, height = capped_size(width, height)
    return height // multiple * multiple, width // multiple * multiple


def reference_pixels(image: Image.Image, multiple: int) -> Tensor:
    """A reference image as the VAE takes it (1, 3, h, w) in [-1, 1]: Lanczos-scaled to the
    area cap if larger, then center-cropped to `reference_size` (Flux2ImageProcessor)."""
    if capped_size(*image.size) != image.size:
        image = image.resize(capped_size(*image.size), Image.Resampling.LANCZOS)
    h, w = reference_size(*image.size, multiple)
    left, top = (image.width - w) // 2, (image.height - h) // 2
    return preprocess(image.crop((left, top, left + w, top + h)), h, w)


def position_ids(time: int, h: int, w: int, length: int = 1) -> Tensor:
    """(h * w * length, 4) rope positions (time, row, col, l), row-major as diffusers'
    cartesian_prod."""
    return torch.cartesian_prod(torch.tensor([time]), torch.arange(h), torch.arange(w),
                                torch.arange(length))


def text_ids(length: int) -> Tensor:
    """(length, 4): text token l sits at (0, 0, 0, l)."""
    return position_ids(0, 1, 1, length)


def rope_key(request: DiffusionRequest) -> tuple:
    """What rows of one transformer call share: the token grid, the reference images' ids,
    the text length."""
    return (tuple(request.cond["grid"].tolist()),
            tuple(request.cond["ref_grids"].flatten().tolist()),
            request.cond["prompt_embeds"].shape[1])


# ---- pipeline --------------------------------------------------------------------------------

class Flux2Pipeline(LatentPipelineBase):
    """FLUX.2-dev: guidance-distilled (the guidance scale is embedded, never a CFG branch).
    Flux2KleinPipeline below adds klein's CFG."""

    label = "FLUX.2"
    transformer_cls = Flux2Transformer2DModel
    vae_cls = AutoencoderKLFlux2
    prompt_encoder_cls = Flux2PromptEncoder
    max_size = MAX_SIZE
    max_input_images = MAX_INPUT_IMAGES     # reference images of an edit
    graphable = True
    is_distilled = True                     # no CFG branch
    embeds_guidance = True                  # the scale goes to the guidance embedding

    @classmethod
    def from_pretrained(cls, path: str | Path, component: str, device: torch.device,
                        dtype: torch.dtype | None, text_encoders: bool = True,
                        offload: int = 0) -> Flux2Pipeline:
        """A diffusers folder as `LatentPipelineBase.from_pretrained`; klein's
        model_index.json may say `is_distilled`."""
        pipe = super().from_pretrained(path, component, device, dtype, text_encoders, offload)
        pipe.is_distilled = cls.is_distilled or is_distilled(Path(path))
        return pipe

    def check_text_params(self, prompt: str | None, params: DiffusionParams) -> None:
        check_text_params(prompt, params, self.is_distilled)

    def validate(self, prompt: str | None, params: DiffusionParams,
                 image: Image.Image | None = None) -> None:
        for i, ref in enumerate(opened_images(params, image)):
            check_reference(ref, i)
        super().validate(prompt, params, image)

    def _size(self, params: DiffusionParams, image: Image.Image | None = None
              ) -> tuple[int, int]:
        """As asked; else the first reference image's encoded size; else the default. Without
        the decoded image (`image`, the engine's), `params.image`'s header gives its size."""
        first = image
        if first is None and isinstance(params.image, bytes):
            first = peek_image(params.image)
        if first is None or (params.height and params.width):
            return params.height or self.default_size, params.width or self.default_size
        height, width = reference_size(*first.size, self.multiple)
        return params.height or height, params.width or width

    def check_conditioning(self, tensors: dict[str, Tensor], params: DiffusionParams
                           ) -> dict[str, Tensor]:
        """prompt_embeds (1, S, joint_dim) [and negative_prompt_embeds with CFG]."""
        text = (3, self.transformer.cfg.joint_attention_dim)
        expected = {"prompt_embeds": text}
        if has_cfg(params, self.is_distilled):
            expected["negative_prompt_embeds"] = text
        return check_conditioning(tensors, expected, self.device, self.dtype)

    def prepare_latents(self, params: DiffusionParams, generator: torch.Generator,
                        image: Image.Image | None = None
                        ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """-> latent tokens (n, N, 4C), sigmas, {"grid": (2,), "ref_tokens": (1, M, 4C),
        "ref_ids": (M, 4), "ref_grids": (K, 2)} (no reference: empty ones)."""
        height, width = self._size(params, image)
        gh, gw = height // self.multiple, width // self.multiple              # token grid
        c4 = self.transformer.cfg.in_channels
        noise = torch.randn((params.num_images, c4, gh, gw), generator=generator,
                            device=generator.device, dtype=self.dtype).to(self.device)
        latents = noise.flatten(2).transpose(1, 2)                               # (n, N, 4C)
        base = np.linspace(1.0, 1 / params.num_inference_steps, params.num_inference_steps)
        mu = compute_empirical_mu(gh * gw, params.num_inference_steps)
        sigmas = solver.make_sigmas(self.scheduler, params.num_inference_steps, mu=mu,
                                    sigmas=base)[0]
        ref_tokens, ref_ids, ref_grids = self.encode_references(input_images(params, image))
        return latents, sigmas, {"grid": torch.tensor([gh, gw]), "ref_tokens": ref_tokens,
                                 "ref_ids": ref_ids, "ref_grids": ref_grids}

    @torch.inference_mode()
    def encode_references(self, images: list[Image.Image]) -> tuple[Tensor, Tensor, Tensor]:
        """Reference images -> their tokens (1, M, 4C) in the model dtype, position ids
        (M, 4) and token grids (K, 2), image after image (`prepare_image_latents`)."""
        tokens = [torch.zeros(0, self.transformer.cfg.in_channels, device=self.device,
                              dtype=self.dtype)]
        ids, grids = [torch.zeros(0, 4, dtype=torch.long)], []
        for i, image in enumerate(images):
            pixels = reference_pixels(image, self.multiple).to(self.device, self.vae_dtype)
            patches = self.vae.normalize(self.vae.encode(pixels))                # (1, 4C, h, w)
            tokens.append(patches[0].flatten(1).T.to(self.dtype))                # (h*w, 4C)
            ids.append(position_ids(REFERENCE_TIME_SCALE * (i + 1), *patches.shape[2:]))
            grids.append(patches.shape[2:])
        return (torch.cat(tokens)[None], torch.cat(ids),
                torch.tensor(grids, dtype=torch.long).reshape(-1, 2))

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """latents (R, N, 4C) -> (R, N, 4C). One forward per set of requests whose rope ids
        agree (token grid, reference images' grids, text length)."""
        return forward_by_key(latents, sigmas, requests, rope_key, self._forward)

    def _forward(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """Requests with the same rope ids: every row with its prompt, then the CFG rows again
        with their negative prompt, in one transformer call."""
        counts = [r.latents.shape[0] for r in requests]
        guided = GuidedRows.of(requests, lambda r: has_cfg(r.params, self.is_distilled),
                               lambda r: r.params.guidance(DEFAULT_GUIDANCE))
        owner = [i for i, n in enumerate(counts) for _ in range(n)]        # request of each row
        uncond_rows = guided.idx.tolist()
        x = torch.cat([torch.cat([rows, r.cond["ref_tokens"].expand(len(rows), -1, -1)], dim=1)
                       for r, rows in zip(requests, latents.split(counts))])    # (R, N+M, 4C)
        embeds = torch.cat([requests[i].cond["prompt_embeds"] for i in owner] +
                           [requests[owner[j]].cond["negative_prompt_embeds"]
                            for j in uncond_rows])                               # (R+U, S, J)
        idx = guided.idx.to(latents.device)
        timestep = (sigmas * self.scheduler.num_train_timesteps).to(latents.dtype) / 1000
        gh, gw = requests[0].cond["grid"].tolist()
        img_ids = torch.cat([position_ids(0, gh, gw), requests[0].cond["ref_ids"]])
        guidance = None
        if self.embeds_guidance and self.transformer.cfg.guidance_embeds:
            guidance = torch.tensor([requests[i].params.guidance(DEFAULT_GUIDANCE)
                                     for i in owner + [owner[j] for j in uncond_rows]],
                                    dtype=torch.float32, device=self.device)
        step_cache = None
        if any(r.params.cache_threshold is not None for r in requests):
            step_cache = cache_groups(requests, counts, guided.branches())
        pred = self.run_transformer(
            torch.cat([x, x[idx]]), embeds, torch.cat([timestep, timestep[idx]]),
            img_ids=img_ids.to(self.device, self.dtype),
            txt_ids=text_ids(embeds.shape[1]).to(self.device, self.dtype), guidance=guidance,
            step_cache=step_cache)[:, :latents.shape[1]]                          # (R+U, N, 4C)
        pos, neg = pred[:len(x)], pred[len(x):]
        if len(uncond_rows):
            g = torch.tensor([requests[owner[j]].params.guidance(DEFAULT_GUIDANCE)
                              for j in uncond_rows], dtype=pred.dtype, device=pred.device)
            pos = pos.clone()
            pos[idx] = neg + g.view(-1, 1, 1) * (pos[idx] - neg)
        return pos

    def decode_float(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        """latent tokens (n, N, 4C) -> float32 images (n, 3, H, W) in [0, 1], what diffusers
        returns for output_type="pt"."""
        height, width = self._size(params)
        patches = latents.transpose(1, 2).unflatten(2, (height // self.multiple,
                                                        width // self.multiple))
        z = self.vae.denormalize(patches.to(self.device, self.vae_dtype))   # (n, C, h, w)
        images = self.vae.decode_images(z)                   # (n, 3, H, W); tiles if huge
        return (images / 2 + 0.5).clamp(0, 1).float()


class Flux2KleinPipeline(Flux2Pipeline):
    """FLUX.2 [klein]: CFG with a negative prompt unless step-distilled (model_index.json);
    no guidance embedding."""

    prompt_encoder_cls = Flux2KleinPromptEncoder
    is_distilled = False
    embeds_guidance = False
