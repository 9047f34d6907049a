"""Qwen-Image text-to-image and image-to-image: diffusers' `QwenImagePipeline.__call__` and
`QwenImageImg2ImgPipeline.__call__` split into the engine's phases
(omnistage/diffusion/pipeline.py), numerics kept step for step.

    encode:   prompt template -> Qwen2.5-VL -> hidden_states[-1] of the real tokens, less the
              template's first 34 (system prompt), at most max_sequence_length: (L, hidden) per
              prompt; the negative prompt the same way when true CFG is on; all prompts of a
              batch of requests in one call, right-padded and masked (QwenImagePromptEncoder)
    prepare:  randn (n, C, 2*(H//16), 2*(W//16)) in the model dtype on the request's CPU
              generator -> pack 2x2 -> (n, N, 4C)
              sigmas linspace(1, 1/N, N) shifted by mu(image tokens), as FLUX
              image-to-image: the schedule starts at the strength's step; the input image,
              encoded (a posterior draw, before the noise) and normalized, is noised to it
    velocity: one transformer call over all rows: every row with its prompt, then the rows of
              requests with true CFG again with their negative prompt; captions zero-padded
              to the longest and masked; timestep = (sigma * 1000 in the latents' dtype) / 1000
              true CFG: comb = neg + s * (pos - neg), rescaled per token to the norm of pos
              CFG-parallel (2 ranks): the prompt rows on CFG rank 0, the negative rows on rank
              1, both gathered on both ranks before the combine
    decode:   unpack -> z * std + mean per channel -> causal VAE (one frame) -> (x/2 + 0.5)
              .clamp(0, 1) -> uint8

Every network is ours: the Qwen2.5-VL text model run as an encoder (its vision tower is not
loaded), the transformer and the VAE; the tokenizer comes from transformers. The encoder may
run in a stage of its own (configs/qwen_image_split.yaml; see diffusion/pipeline.py).
Qwen-Image is not guidance-distilled: true CFG is the guidance. As in diffusers (and
vLLM-Omni), what it cannot use is accepted with a logged warning (`unused_params`):
`guidance_scale`, `true_cfg_scale` without a negative prompt, a negative prompt without
`true_cfg_scale` > 1.
Step caching per request and CFG branch (identity rescaling: see qwen_image_transformer.py).
Splits along every parallel axis: CFG-parallel here, tensor and sequence parallelism in the
transformer.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor
from transformers import AutoTokenizer

from omnistage.diffusion.cfg import GuidedRows, run_branches
from omnistage.diffusion.image_input import image_to_image, noised_image
from omnistage.diffusion.latent_pipeline import LatentPipelineBase
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipeline import check_conditioning, encode_with_negatives
from omnistage.diffusion.pipelines.flux import pack_latents, unpack_latents
from omnistage.diffusion.request import DiffusionRequest
from omnistage.layers.step_cache import cache_groups
from omnistage.models.autoencoder_kl_qwen_image import AutoencoderKLQwenImage
from omnistage.models.qwen_image_transformer import QwenImageTransformer2DModel
from omnistage.models.text_encoders import QwenTextEncoder

MAX_SIZE = 2048
MAX_SEQUENCE_LENGTH = 1024          # caption tokens after the template; diffusers' maximum
DEFAULT_SEQUENCE_LENGTH = 512       # diffusers' default
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
PROMPT_TEMPLATE_DROP = 34           # leading template tokens whose states are dropped


logger = logging.getLogger(__name__)
_warned: set[str] = set()


def has_true_cfg(params: DiffusionParams) -> bool:
    """diffusers' `do_true_cfg`: a scale above 1 and a negative prompt, else no true CFG."""
    return params.true_cfg_scale > 1.0 and params.negative_prompt is not None


def unused_params(params: DiffusionParams) -> dict[str, str]:
    """The fields of `params` Qwen-Image accepts and does not use, and why: the cases where
    diffusers' QwenImagePipeline warns and goes on."""
    unused: dict[str, str] = {}
    if params.negative_prompt is not None and params.true_cfg_scale <= 1.0:
        unused["negative_prompt"] = (f"true CFG is off (true_cfg_scale="
                                     f"{params.true_cfg_scale}; set it > 1, e.g. 4.0)")
    if params.negative_prompt is None and params.true_cfg_scale != 1.0:
        unused["true_cfg_scale"] = ("true CFG needs a negative_prompt (even \" \" turns it "
                                    "on, as in diffusers)")
    if params.guidance_scale is not None:
        unused["guidance_scale"] = ("Qwen-Image is not guidance-distilled; its guidance is "
                                    "true_cfg_scale > 1 with a negative_prompt")
    return unused


def check_text_params(prompt: str | None, params: DiffusionParams) -> None:
    """The request's text and guidance fields (prompt None: encoded upstream, not checked);
    what goes unused is logged (once per field), as diffusers warns."""
    if prompt is not None and not prompt.strip():
        raise ValueError("prompt: must be non-empty")
    for name, why in unused_params(params).items():
        if name not in _warned:
            _warned.add(name)
            logger.warning("%s: accepted and ignored (%s)", name, why)


class QwenImagePromptEncoder:
    """Qwen2.5-VL over the templated prompts: the text part of `QwenImagePipeline.prepare`,
    batched over requests. The one place that knows the text encoder."""

    def __init__(self, text_encoder: QwenTextEncoder, tokenizer, device: torch.device,
                 max_sequence_length: int = DEFAULT_SEQUENCE_LENGTH) -> None:
        if not 1 <= max_sequence_length <= MAX_SEQUENCE_LENGTH:
            raise ValueError(f"max_sequence_length={max_sequence_length}: must be in "
                             f"[1, {MAX_SEQUENCE_LENGTH}]")
        self.text_encoder = text_encoder.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.max_sequence_length = max_sequence_length

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device,
                        dtype: torch.dtype | None) -> QwenImagePromptEncoder:
        """The pipeline folder's text_encoder/ (in `dtype`; None: its own) and tokenizer/."""
        path = Path(path)
        text_encoder = QwenTextEncoder.from_pretrained(path / "text_encoder", device, dtype)
        return cls(text_encoder, AutoTokenizer.from_pretrained(path / "tokenizer"), device)

    def validate(self, prompt: str, params: DiffusionParams) -> None:
        check_text_params(prompt, params)

    def encode(self, prompts: list[str], params: list[DiffusionParams]
               ) -> list[dict[str, Tensor]]:
        """Per request: prompt_embeds (L, hidden), and negative_prompt_embeds with true CFG."""
        return encode_with_negatives(self.encode_texts, prompts, params, has_true_cfg)

    @torch.inference_mode()
    def encode_texts(self, texts: list[str]) -> list[Tensor]:
        """-> per text, the caption's states (L, hidden): hidden_states[-1] of the templated
        text, less the template's first PROMPT_TEMPLATE_DROP tokens, at most
        max_sequence_length. Right padding: causal attention leaves the real tokens alone."""
        inputs = self.tokenizer([PROMPT_TEMPLATE.format(t) for t in texts],
                                max_length=MAX_SEQUENCE_LENGTH + PROMPT_TEMPLATE_DROP,
                                truncation=True, padding=True, padding_side="right",
                                return_tensors="pt")
        mask = inputs.attention_mask.to(self.device)                        # (B, S)
        hidden = self.text_encoder(inputs.input_ids.to(self.device), mask,
                                   output_layers=(-1,))[-1]                  # (B, S, J)
        return [h[m.bool()][PROMPT_TEMPLATE_DROP:][:self.max_sequence_length]
                for h, m in zip(hidden, mask)]                               # (L_i, J) each


class QwenImagePipeline(LatentPipelineBase):
    label = "Qwen-Image"
    transformer_cls = QwenImageTransformer2DModel
    vae_cls = AutoencoderKLQwenImage
    prompt_encoder_cls = QwenImagePromptEncoder
    max_size = MAX_SIZE
    check_text_params = staticmethod(check_text_params)
    unused_params = staticmethod(unused_params)     # type: ignore[assignment]
    parallel_axes = ("cfg", "ulysses", "ring", "tp")
    graphable = True

    # ---- 1. prepare (encode: the base class) ---------------------------------------------

    def check_conditioning(self, tensors: dict[str, Tensor], params: DiffusionParams
                           ) -> dict[str, Tensor]:
        """prompt_embeds (L, J) [and negative_prompt_embeds (L', J) with true CFG]."""
        joint = (2, self.transformer.cfg.joint_attention_dim)
        expected = {"prompt_embeds": joint}
        if has_true_cfg(params):
            expected["negative_prompt_embeds"] = joint
        return check_conditioning(tensors, expected, self.device, self.dtype)

    def prepare_latents(self, params: DiffusionParams, generator: torch.Generator,
                        image: Image.Image | None = None
                        ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """-> packed latents (n, N, 4C), sigmas, {"grid": packed token grid (2,)}."""
        n = params.num_images
        # timesteps: linspace(1, 1/N, N), shifted by the number of image tokens
        height, width, h, w, sigmas = self.latent_schedule(params, image=image)

        # latents: noise in the model dtype (diffusers' (n, 1, C, h, w) draws the same
        # numbers); image-to-image draws the image's posterior sample first, then the noise,
        # and noises the image to the first sigma of the strength-shortened schedule
        image_latents = None
        img2img = image_to_image(params, sigmas, height, width, image)
        if img2img is not None:
            sigmas, image = img2img                                          # (1, 3, H, W)
            image = image.unsqueeze(2).to(self.device, self.vae_dtype)       # (1, 3, 1, H, W)
            image_latents = self.vae.normalize(self.vae.sample_latents(image, generator))
            image_latents = image_latents[:, :, 0].to(self.dtype)            # (1, C, h, w)
        noise = torch.randn((n, self.num_channels_latents, h, w), generator=generator,
                            device=generator.device, dtype=self.dtype).to(self.device)
        if image_latents is not None:
            noise = noised_image(image_latents, sigmas[0], noise)
        latents = pack_latents(noise)                                        # (n, h/2*w/2, 4C)
        return latents, sigmas, {"grid": torch.tensor([h // 2, w // 2])}   # packed token grid

    # ---- 2. velocity -----------------------------------------------------------------------

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """latents (R, N, 4C) -> (R, N, 4C). One forward per latent grid: sizes such as 32x64
        and 64x32 pack to the same N (one engine batch) but need different image rope."""
        rows = torch.arange(latents.shape[0]).split([r.latents.shape[0] for r in requests])
        groups: dict[tuple[tuple[int, int, int], ...], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(self.img_shapes(r), []).append(i)
        if len(groups) == 1:
            return self._forward(latents, sigmas, requests)
        out = torch.empty_like(latents)
        for members in groups.values():
            idx = torch.cat([rows[i] for i in members]).to(latents.device)
            out[idx] = self._forward(latents[idx], sigmas[idx], [requests[i] for i in members])
        return out

    def _forward(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """Requests on one latent grid: the conditional pass of every row and the
        unconditional pass of the true-CFG rows, in one transformer call (CFG-parallel: the
        first on CFG rank 0, the second on rank 1).

            rows:  | r0 img0 | r0 img1 | r1 img0 | ... |  r0 img0 | r0 img1 |   (r1: no CFG)
                   |<------ prompt, R rows -------->|  |<-- negative, U -->|
        """
        counts = [r.latents.shape[0] for r in requests]
        guided = GuidedRows.of(requests, lambda r: "negative_prompt_embeds" in r.cond,
                               lambda r: r.params.true_cfg_scale)
        captions = [r.cond["prompt_embeds"] for r, n in zip(requests, counts) for _ in range(n)]
        neg_captions = [r.cond["negative_prompt_embeds"] for r, n, g
                        in zip(requests, counts, guided.guided) if g for _ in range(n)]
        num_rows = latents.shape[0]
        # diffusers: t = sigma * 1000 (the scheduler's timesteps) in the latents' dtype, / 1000
        timestep = (sigmas * self.scheduler.num_train_timesteps).to(latents.dtype) / 1000
        idx = guided.idx.to(latents.device)
        branches = [(latents, timestep, captions), (latents[idx], timestep[idx], neg_captions)]
        names = guided.branches()

        def run(chosen: list[int]) -> Tensor:
            xs, ts, cs = (list(parts) for parts in zip(*(branches[b] for b in chosen)))
            texts = [c for part in cs for c in part]
            return self._transformer(torch.cat(xs), torch.cat(ts), texts,
                                     [names[b] for b in chosen], requests, counts)

        out = run_branches(self.cfg_ranks, [num_rows, len(idx)], run, latents)  # (R+U, N, 4C)
        pred, neg = out[:num_rows], out[num_rows:]
        for rows, uncond, scale in guided.pairs(pred, neg):  # per request: its scale, a float
            pos = pred[rows]
            comb = uncond + scale * (pos - uncond)
            pred[rows] = comb * (torch.norm(pos, dim=-1, keepdim=True)
                                 / torch.norm(comb, dim=-1, keepdim=True))
        return pred

    def img_shapes(self, request: DiffusionRequest) -> tuple[tuple[int, int, int], ...]:
        """The (frames, rows, cols) token grid of each image a request's rows carry: here its
        latents' alone (an edit adds its input images')."""
        h, w = request.cond["grid"].tolist()
        return ((1, h, w),)

    def model_input(self, latents: Tensor, branches: list[tuple[str, list[bool]]],
                    requests: list[DiffusionRequest], counts: list[int]) -> Tensor:
        """The transformer's image tokens for rows laid out as `_transformer`'s: here the
        latents themselves (an edit appends its input images' tokens)."""
        return latents

    def _transformer(self, latents: Tensor, timestep: Tensor, captions: list[Tensor],
                     branches: list[tuple[str, list[bool]]], requests: list[DiffusionRequest],
                     counts: list[int]) -> Tensor:
        """One transformer call over rows laid out branch after branch (`branches`: name and
        which requests have rows in it), with step caching when any request asks for it.
        Returns the velocity of the latents' tokens only."""
        embeds, mask = pad_captions(captions)                                # (rows, T, J)
        step_cache = None
        if any(r.params.cache_threshold is not None for r in requests):
            step_cache = cache_groups(requests, counts, branches)
        hidden = self.model_input(latents, branches, requests, counts)     # (rows, N + M, 4C)
        out = self.run_transformer(hidden, embeds, mask, timestep,
                                   img_shapes=[list(self.img_shapes(requests[0]))] * len(hidden),
                                   step_cache=step_cache)
        return out[:, :latents.shape[1]]                                     # (rows, N, 4C)

    # ---- 3. decode -------------------------------------------------------------------------

    def decode_float(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        """packed latents (n, N, 4C) -> float32 images (n, 3, H, W) in [0, 1], what diffusers
        returns for output_type="pt" (before the quantization of `decode`)."""
        height, width = self._size(params)
        h, w = 2 * (height // self.multiple), 2 * (width // self.multiple)
        z = unpack_latents(latents, h, w).unsqueeze(2)                      # (n, C, 1, h, w)
        z = self.vae.denormalize(z.to(self.device, self.vae_dtype))
        images = self.vae.decode(z)[:, :, 0]                                # (n, 3, H, W)
        return (images / 2 + 0.5).clamp(0, 1).float()



def pad_captions(captions: list[Tensor]) -> tuple[Tensor, Tensor | None]:
    """[(L_i, J)] -> zero-padded (B, max L, J) and its mask (B, max L), True on real tokens;
    no mask when every caption has the same length (what diffusers passes for one prompt)."""
    lengths = [c.shape[0] for c in captions]
    longest = max(lengths)
    if all(n == longest for n in lengths):
        return torch.stack(captions), None
    embeds = captions[0].new_zeros(len(captions), longest, captions[0].shape[1])
    mask = torch.zeros(len(captions), longest, dtype=torch.bool, device=embeds.device)
    for i, c in enumerate(captions):
        embeds[i, :c.shape[0]] = c
        mask[i, :c.shape[0]] = True
    return embeds, mask
