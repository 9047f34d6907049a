"""Z-Image / Z-Image-Turbo text-to-image: diffusers' `ZImagePipeline.__call__` split into the
engine's phases (omnistage/diffusion/pipeline.py), numerics kept step for step.

    encode:   chat template -> Qwen3 (padded to max_sequence_length) -> hidden_states[-2], the
              real (attention-mask) tokens only: (L, cap_feat_dim), one per prompt; the negative
              prompt ("" by default) the same way when CFG is on (guidance_scale > 0); all
              prompts of a batch of requests in one call (ZImagePromptEncoder)
    prepare:  randn (n, C, 2*(H//16), 2*(W//16)) float32 on the request's CPU generator, unpacked
              sigmas torch.linspace(1, 1/N, N) through the scheduler (shift, or mu when dynamic)
    velocity: one transformer call over all rows, cond rows then uncond rows;
              timestep = (1000 - sigma*1000) / 1000; pred = pos + g * (pos - neg); v = -pred
    decode:   z / scaling + shift -> VAE -> (x/2 + 0.5).clamp(0, 1) -> uint8

Every network is ours (Qwen3 text encoder, transformer, VAE); the tokenizer comes from
transformers. The text encoder may run in a stage of its own (configs/z_image_split.yaml; see
diffusion/pipeline.py).
Not ported: cfg_normalization and cfg_truncation < 1 (diffusers' defaults, off, are what runs).
Splits by CFG-parallel (the cond rows on CFG rank 0, the uncond rows on rank 1, gathered before
the combine) and tensor parallelism (in the transformer); not by sequence parallelism.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from torch import Tensor
from transformers import AutoTokenizer

from omnistage.layers.step_cache import cache_groups
from omnistage.diffusion.image_input import image_to_image, noised_image
from omnistage.diffusion.cfg import GuidedRows, run_branches
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.latent_pipeline import LatentPipelineBase
from omnistage.diffusion.pipeline import check_conditioning, encode_with_negatives
from omnistage.diffusion.request import DiffusionRequest
from omnistage.models.autoencoder_kl import AutoencoderKL
from omnistage.models.text_encoders import QwenTextEncoder
from omnistage.models.z_image_transformer import ZImageTransformer2DModel

MAX_SIZE = 2048
DEFAULT_SIZE = 1024                 # pixels, diffusers' `height or 1024`
DEFAULT_GUIDANCE = 5.0              # diffusers' default; Z-Image-Turbo is run with 0.0
MAX_SEQUENCE_LENGTH = 512           # Qwen3 tokens, diffusers' default


def has_cfg(params: DiffusionParams) -> bool:
    """diffusers' `do_classifier_free_guidance`: guidance_scale > 0 (5.0 by default)."""
    return params.guidance(DEFAULT_GUIDANCE) > 0


def check_text_params(prompt: str | None, params: DiffusionParams) -> None:
    """The request's text and guidance fields (prompt None: encoded upstream, not checked)."""
    if prompt is not None and not prompt.strip():
        raise ValueError("prompt: must be non-empty")
    if params.true_cfg_scale != 1.0:
        raise ValueError("true_cfg_scale: Z-Image has no separate true CFG; use "
                         "guidance_scale (> 0 turns on CFG with negative_prompt)")
    if params.negative_prompt is not None and not has_cfg(params):
        raise ValueError("negative_prompt: has no effect with guidance_scale=0 (CFG off)")


class ZImagePromptEncoder:
    """Qwen3 over the chat-templated prompts: the text part of `ZImagePipeline.prepare`,
    batched over requests."""

    def __init__(self, text_encoder: QwenTextEncoder, tokenizer, device: torch.device,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> None:
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length={max_sequence_length}: must be >= 1")
        self.text_encoder = text_encoder.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.max_sequence_length = max_sequence_length

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device,
                        dtype: torch.dtype | None) -> ZImagePromptEncoder:
        """The pipeline folder's text_encoder/ (a Qwen3Model or Qwen3ForCausalLM checkpoint,
        run as an encoder; in `dtype`, None: its own) and tokenizer/."""
        path = Path(path)
        text_encoder = QwenTextEncoder.from_pretrained(path / "text_encoder", device, dtype)
        return cls(text_encoder, AutoTokenizer.from_pretrained(path / "tokenizer"), device)

    def validate(self, prompt: str, params: DiffusionParams) -> None:
        check_text_params(prompt, params)

    def encode(self, prompts: list[str], params: list[DiffusionParams]
               ) -> list[dict[str, Tensor]]:
        """Per request: prompt_embeds (L, hidden), and negative_prompt_embeds with CFG."""
        return encode_with_negatives(self.encode_texts, prompts, params, has_cfg)

    @torch.inference_mode()
    def encode_texts(self, texts: list[str]) -> list[Tensor]:
        """-> per text, Qwen3 hidden_states[-2] of its real tokens (L_i, hidden)."""
        chats = [self.tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True,
            enable_thinking=True) for t in texts]
        inputs = self.tokenizer(chats, padding="max_length", max_length=self.max_sequence_length,
                                truncation=True, return_tensors="pt")
        mask = inputs.attention_mask.to(self.device).bool()                 # (B, S)
        hidden = self.text_encoder(inputs.input_ids.to(self.device), mask,
                                   output_layers=(-2,))[-2]                  # (B, S, J)
        return [h[m] for h, m in zip(hidden, mask)]


class ZImagePipeline(LatentPipelineBase):
    label = "Z-Image"
    # compiled blocks: 0.81 s against 1.25 eager for 8 steps at 1024px on an H100 (its blocks
    # have no fused kernels; diffusion_variants_z-image-turbo_1024px.json)
    compile_default = True
    transformer_cls = ZImageTransformer2DModel
    vae_cls = AutoencoderKL
    prompt_encoder_cls = ZImagePromptEncoder
    max_size = MAX_SIZE
    check_text_params = staticmethod(check_text_params)
    packed = False
    default_size = DEFAULT_SIZE
    parallel_axes = ("cfg", "ulysses", "ring", "tp")
    heads_key = "n_heads"

    # ---- 1. prepare (encode: the base class) ---------------------------------------------

    def check_conditioning(self, tensors: dict[str, Tensor], params: DiffusionParams
                           ) -> dict[str, Tensor]:
        """prompt_embeds (L, cap_feat_dim) [and negative_prompt_embeds (L', cap_feat_dim) with
        CFG]."""
        caption = (2, self.transformer.cfg.cap_feat_dim)
        expected = {"prompt_embeds": caption}
        if has_cfg(params):
            expected["negative_prompt_embeds"] = caption
        return check_conditioning(tensors, expected, self.device, self.dtype)

    def prepare_latents(self, params: DiffusionParams, generator: torch.Generator,
                        image: Image.Image | None = None
                        ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """-> latents (n, C, h, w), sigmas, {} (no other conditioning)."""
        n = params.num_images
        # timesteps: linspace(1, 1/N, N) in torch float32, then the scheduler's shift
        height, width, h, w, sigmas = self.latent_schedule(params, float32_linspace=True,
                                                           image=image)

        # prepare_latents, kept (n, C, h, w): text-to-image draws float32 noise whatever the
        # model dtype; image-to-image (ZImageImg2ImgPipeline) encodes the image first, then
        # draws noise in the model dtype and noises the image to the shortened schedule's start
        shape = (n, self.num_channels_latents, h, w)
        img2img = image_to_image(params, sigmas, height, width, image)
        if img2img is None:
            latents = torch.randn(shape, generator=generator, device=generator.device,
                                  dtype=torch.float32).to(self.device)
            return latents, sigmas, {}
        sigmas, image = img2img
        image_latents = self.vae.normalize(self.vae.sample_latents(
            image.to(self.device, self.vae_dtype), generator)).to(self.dtype)  # (1, C, h, w)
        noise = torch.randn(shape, generator=generator, device=generator.device,
                            dtype=self.dtype).to(self.device)
        latents = noised_image(image_latents, sigmas[0], noise)
        return latents, sigmas, {}

    # ---- 2. velocity -----------------------------------------------------------------------

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """latents (R, C, h, w) float32 -> (R, C, h, w) float32. All rows' conditional passes,
        then the unconditional passes of rows with CFG, in one transformer call (captions and
        images may differ in length; the transformer masks; CFG-parallel: diffusion/cfg.py)."""
        counts = [r.latents.shape[0] for r in requests]
        guided = GuidedRows.of(requests, lambda r: has_cfg(r.params),
                               lambda r: r.params.guidance(DEFAULT_GUIDANCE))
        scales = [r.params.guidance(DEFAULT_GUIDANCE) for r, n in zip(requests, counts)
                  for _ in range(n)]
        caps = [r.cond["prompt_embeds"] for r, n in zip(requests, counts) for _ in range(n)]
        uncond_caps = [r.cond["negative_prompt_embeds"] for r, n in zip(requests, counts)
                       for _ in range(n) if has_cfg(r.params)]
        # diffusers: t = sigma * 1000 (the scheduler's timesteps), fed as (1000 - t) / 1000
        timestep = (1000 - sigmas.float() * self.scheduler.num_train_timesteps) / 1000   # (R,)
        x = latents.to(self.dtype).unsqueeze(2)                              # (R, C, 1, h, w)
        idx = guided.idx.to(latents.device)
        branches = [(x, timestep, caps), (x[idx], timestep[idx], uncond_caps)]
        names = guided.branches()

        def run(chosen: list[int]) -> Tensor:
            xs, ts, cs = (list(parts) for parts in zip(*(branches[b] for b in chosen)))
            return self._transformer(torch.cat(xs), torch.cat(ts), sum(cs, []),
                                     [names[b] for b in chosen], requests, counts)

        pred = run_branches(self.cfg_ranks, [len(caps), len(uncond_caps)], run, latents)
        pos, neg = pred[:len(scales)], pred[len(scales):]                # (R + U, C, h, w)
        if len(idx):
            g = torch.tensor(scales, dtype=torch.float32, device=pred.device)[idx]
            g = g.reshape(-1, 1, 1, 1)
            pos = pos.clone()
            pos[idx] = pos[idx] + g * (pos[idx] - neg)
        return -pos

    def _transformer(self, x: Tensor, timestep: Tensor, captions: list[Tensor],
                     branches: list[tuple[str, list[bool]]], requests: list[DiffusionRequest],
                     counts: list[int]) -> Tensor:
        """One transformer call over rows (R', C, 1, h, w) laid out branch after branch
        (`branches`: name and which requests have rows in it) -> (R', C, h, w) float32."""
        step_cache = None
        if any(r.params.cache_threshold is not None for r in requests):
            step_cache = cache_groups(requests, counts, branches)
        out = self.transformer(list(x.unbind(0)), timestep, captions, step_cache=step_cache)
        return torch.stack([o.float() for o in out]).squeeze(2)

    # ---- 3. decode -------------------------------------------------------------------------

    def decode_float(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        """latents (n, C, h, w) -> float32 images (n, 3, H, W) in [0, 1], what diffusers
        returns for output_type="pt" (before the quantization of `decode`)."""
        z = self.vae.denormalize(latents.to(self.device, self.vae_dtype))   # (n, C, h, w)
        images = self.vae.decode_images(z)                   # (n, 3, H, W); tiles if huge
        return (images / 2 + 0.5).clamp(0, 1).float()

