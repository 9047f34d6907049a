"""Qwen-Image-Edit and Qwen-Image-Edit-Plus (2509; 2511, whose transformer has zero_cond_t):
diffusers' `QwenImageEditPipeline.__call__` (one input image) and
`QwenImageEditPlusPipeline.__call__` (several) on top of Qwen-Image's phases (qwen_image.py),
whose schedule, true CFG (with the same images for the negative prompt), CFG-parallel, step
caching, denoising and decode they keep. What the input images add:

    sizes:    Edit:  the image resized (Lanczos) to the ~1024x1024-pixel size of its aspect,
                     sides multiples of 32 (`calculate_dimensions`): both what the VL encoder
                     and the VAE see
              Plus:  each image twice: ~384x384 pixels for the VL encoder, ~1024x1024 for the
                     VAE, each of its own aspect
              output: as asked, else the ~1024x1024 size of the first (Edit) / last (Plus)
                     image's aspect, rounded down to multiples of 16
    encode:   the edit template with the images in the user turn ("Picture i: " before each in
              Plus) -> the Qwen2-VL image processor (transformers) -> our Qwen2.5-VL vision
              tower -> its features replace the image placeholder tokens -> our Qwen2.5-VL
              text model with multimodal rotary positions (the images' (t, row, col) grid)
              -> hidden_states[-1], less the template's first 64 tokens; no length cap
    prepare:  each VAE image -> posterior mean -> normalized -> packed: (1, M_i, 4C), appended
              after the noise's N tokens; img_shapes [(1, h/2, w/2), (1, h_i/2, w_i/2), ...]
              give each image its own frame index in the transformer's rotary
    velocity: the transformer sees [latents | image tokens]; only the first N outputs count;
              requests with other img_shapes run in forwards of their own

A request brings its images as DiffusionParams.image and extra_images: one for Edit, one to
MAX_PLUS_IMAGES for Plus (`max_input_images`, which the stage reports so that the front door
refuses more). Every network is ours; the image processor and tokenizer are transformers'. The
encoder runs inside the diffusion stage (no split graph ships: a text-encoder stage would need
the images too).

The multimodal positions differ from diffusers run with transformers >= 5.15, which drops the
processor's `mm_token_type_ids` and silently falls back to 1-D positions (diffusers issue
#14194, PR #14189); this follows the model as trained, which the golden test checks against
diffusers with that PR's fix applied.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omnistage.diffusion.image_input import input_images, opened_images, preprocess
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipeline import encode_with_negatives
from omnistage.diffusion.pipelines.flux import pack_latents
from omnistage.diffusion.pipelines.qwen_image import (QwenImagePipeline, check_text_params,
                                                      has_true_cfg)
from omnistage.diffusion.request import DiffusionRequest
from omnistage.errors import InputError
from omnistage.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer
from omnistage.models.qwen3_omni.mrope import mrope_positions
from omnistage.models.text_encoders import QwenTextEncoder
from omnistage.models.text_encoders.common import read_hf_config

EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
    "texture, objects, background), then explain how the user's text instruction should alter "
    "or modify the image. Generate a new image that meets the user's requirements while "
    "maintaining consistency with the original input where appropriate.<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
EDIT_TEMPLATE_DROP = 64             # leading template tokens whose states are dropped
IMAGE_TOKEN = "<|image_pad|>"
VISION_PLACEHOLDER = "<|vision_start|>" + IMAGE_TOKEN + "<|vision_end|>"
TARGET_AREA = 1024 * 1024           # pixels of the VAE images and of the default output
CONDITION_AREA = 384 * 384          # pixels of Edit-Plus's images for the VL encoder
SIZE_STEP = 32                      # `calculate_dimensions` rounds sides to this
# Edit-Plus: diffusers sets no limit; Qwen-Image-Edit-2509 is documented for 1 to 3 images,
# and every image adds ~4k tokens to each transformer call at the default size
MAX_PLUS_IMAGES = 3


def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """(width, height) of about `area` pixels at aspect `ratio` (width / height), each rounded
    to a multiple of 32: diffusers' `calculate_dimensions`."""
    width = math.sqrt(area * ratio)
    return round(width / SIZE_STEP) * SIZE_STEP, round(width / ratio / SIZE_STEP) * SIZE_STEP


def check_edit_text(prompt: str | None, params: DiffusionParams) -> None:
    """Qwen-Image's text checks, and no image placeholder in the texts: each stands for an
    input image's features, which the text does not bring."""
    check_text_params(prompt, params)
    for name, text in (("prompt", prompt), ("negative_prompt", params.negative_prompt)):
        if text is not None and IMAGE_TOKEN in text:
            raise InputError(f"{name}: must not contain {IMAGE_TOKEN} (the input images' "
                             "placeholder)", name)


def resize(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """To (width, height) with Lanczos, as diffusers' VaeImageProcessor.resize."""
    return image if image.size == size else image.resize(size, Image.Resampling.LANCZOS)


class QwenImageEditPromptEncoder:
    """Qwen2.5-VL over the templated edit prompts and their images: the encode part of
    `QwenImageEditPipeline`, batched over requests (every text with its own images)."""

    condition_area = TARGET_AREA    # pixels each image is resized to (its aspect) first
    numbered = False                # "Picture i: " before each image (Edit-Plus)

    def __init__(self, text_encoder: QwenTextEncoder, vision: Qwen2_5_VisionTransformer,
                 image_processor: Qwen2VLImageProcessorPil, tokenizer, image_token_id: int,
                 device: torch.device) -> None:
        if tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) != image_token_id:
            raise ValueError(f"processor/ tokenizer: {IMAGE_TOKEN} is id "
                             f"{tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)}, the text "
                             f"encoder's image_token_id is {image_token_id}")
        if image_processor.merge_size != vision.cfg.spatial_merge_size:
            raise ValueError(f"processor/ merge_size {image_processor.merge_size} != the vision "
                             f"tower's spatial_merge_size {vision.cfg.spatial_merge_size}")
        self.text_encoder = text_encoder.to(device).eval()
        self.vision = vision.to(device).eval()
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id
        self.device = device

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device,
                        dtype: torch.dtype | None) -> QwenImageEditPromptEncoder:
        """The folder's text_encoder/ (language model and vision tower, in `dtype`; None: its
        own) and processor/ (the Qwen2-VL image processor and its tokenizer)."""
        path = Path(path)
        text_encoder = QwenTextEncoder.from_pretrained(path / "text_encoder", device, dtype)
        vision = Qwen2_5_VisionTransformer.from_pretrained(path / "text_encoder", device, dtype)
        image_token_id = read_hf_config(path / "text_encoder").image_token_id
        return cls(text_encoder, vision,
                   Qwen2VLImageProcessorPil.from_pretrained(path / "processor"),
                   AutoTokenizer.from_pretrained(path / "processor"), image_token_id, device)

    def validate(self, prompt: str, params: DiffusionParams) -> None:
        check_edit_text(prompt, params)

    def encode(self, prompts: list[str], params: list[DiffusionParams]
               ) -> list[dict[str, Tensor]]:
        """Per request: prompt_embeds (L, hidden), and negative_prompt_embeds with true CFG;
        its input images decoded from its params."""
        images = [input_images(p) for p in params]
        return self.encode_with_images(prompts, params, images)

    def encode_with_images(self, prompts: list[str], params: list[DiffusionParams],
                           images: list[list[Image.Image]]) -> list[dict[str, Tensor]]:
        """`encode` with each request's images given (decoded, in order, as uploaded): each
        resized to ~condition_area pixels first."""
        images = [[resize(im, calculate_dimensions(self.condition_area, im.width / im.height))
                   for im in ims] for ims in images]
        # the texts come as encode_with_negatives lays them out: prompt [, negative] a request
        text_images = [ims for p, ims in zip(params, images, strict=True)
                       for _ in range(2 if has_true_cfg(p) else 1)]
        return encode_with_negatives(lambda texts: self.encode_texts(texts, text_images),
                                     prompts, params, has_true_cfg)

    def user_turn(self, text: str, num_images: int) -> str:
        if not self.numbered:
            return VISION_PLACEHOLDER * num_images + text
        return "".join(f"Picture {i + 1}: {VISION_PLACEHOLDER}" for i in range(num_images)) + text

    @torch.inference_mode()
    def encode_texts(self, texts: list[str], images: list[list[Image.Image]]) -> list[Tensor]:
        """-> per text, its states (L, hidden): hidden_states[-1] of the templated text with its
        images' features in place of their placeholder tokens, less the template's first
        EDIT_TEMPLATE_DROP tokens. Right padding: causal attention leaves real tokens alone."""
        flat = [im for ims in images for im in ims]
        pixels = self.image_processor(flat, return_tensors="pt")
        grids = pixels.image_grid_thw                                         # (I, 3)
        tokens_per_image = self.vision.num_tokens(grids)
        features = self.vision(pixels.pixel_values.to(self.device), grids.to(self.device))
        features = features.split(tokens_per_image)                           # (n_i, J) each
        prompts, k = [], 0
        for text, ims in zip(texts, images, strict=True):
            pieces = EDIT_TEMPLATE.format(self.user_turn(text, len(ims))).split(IMAGE_TOKEN)
            assert len(pieces) == len(ims) + 1, f"{len(pieces) - 1} placeholders, {len(ims)} images"
            prompts.append(pieces[0] + "".join(IMAGE_TOKEN * n + piece for n, piece in
                                               zip(tokens_per_image[k:], pieces[1:])))
            k += len(ims)
        inputs = self.tokenizer(prompts, padding=True, padding_side="right", return_tensors="pt")
        ids, mask = inputs.input_ids.to(self.device), inputs.attention_mask.to(self.device)
        embeds = self.text_encoder.embed_tokens(ids)                          # (B, S, J)
        is_image = ids == self.image_token_id
        embeds[is_image] = torch.cat(features).to(embeds.dtype)
        positions = self._positions(ids, mask, grids, [len(ims) for ims in images])
        hidden = self.text_encoder(ids, mask, (-1,), inputs_embeds=embeds,
                                   position_ids=positions)[-1]                 # (B, S, J)
        return [h[m.bool()][EDIT_TEMPLATE_DROP:] for h, m in zip(hidden, mask)]

    def _positions(self, ids: Tensor, mask: Tensor, grids: Tensor, counts: list[int]) -> Tensor:
        """(3, B, S) multimodal rotary positions of each row's real tokens (its images' grids
        in order); padding keeps 0."""
        out = torch.zeros(3, *ids.shape, dtype=torch.long)
        merge = self.vision.cfg.spatial_merge_size
        for row, grid in enumerate(grids.split(counts)):
            real = ids[row][mask[row].bool()].cpu()
            out[:, row, :real.numel()] = mrope_positions(
                real, image_token_id=self.image_token_id, video_token_id=-1,
                spatial_merge_size=merge, position_id_per_seconds=1.0, image_grid_thw=grid)[0]
        return out.to(ids.device)


class QwenImageEditPlusPromptEncoder(QwenImageEditPromptEncoder):
    """Edit-Plus: small condition images, numbered in the prompt."""

    condition_area = CONDITION_AREA
    numbered = True


class QwenImageEditPipeline(QwenImagePipeline):
    label = "Qwen-Image-Edit"
    prompt_encoder_cls = QwenImageEditPromptEncoder
    check_text_params = staticmethod(check_edit_text)
    max_input_images = 1
    target_area = TARGET_AREA       # pixels of the VAE images and of the default output

    # ---- sizes -----------------------------------------------------------------------------

    def vae_size(self, image: Image.Image) -> tuple[int, int]:
        """(width, height) an input image is encoded at: ~target_area pixels, its aspect."""
        return calculate_dimensions(self.target_area, image.width / image.height)

    def _size(self, params: DiffusionParams, image: Image.Image | None = None
              ) -> tuple[int, int]:
        """As asked; else the size of the reference image's aspect (Edit: the image; Plus: the
        last), rounded down to the model's multiple."""
        if params.height is not None and params.width is not None:
            return params.height, params.width
        opened = opened_images(params, image)
        if not opened:
            raise InputError(f"image: {self.label} edits an input image; none given", "image")
        width, height = self.vae_size(opened[-1])
        m = self.multiple
        return params.height or height // m * m, params.width or width // m * m

    def validate(self, prompt: str | None, params: DiffusionParams,
                 image: Image.Image | None = None) -> None:
        opened = opened_images(params, image)
        if not opened:
            raise InputError(f"image: {self.label} edits an input image; none given", "image")
        if len(opened) > self.max_input_images:
            raise InputError(f"image: {self.label} takes at most {self.max_input_images} input "
                             f"image{'s' if self.max_input_images > 1 else ''}, got "
                             f"{len(opened)}", "image")
        if params.strength is not None:
            raise InputError(f"strength: {self.label} conditions on the image, it does not "
                             "redraw it from a noised copy; leave strength unset", "strength")
        for im in opened:
            width, height = self.vae_size(im)
            if min(width, height) < self.multiple or max(width, height) > self.max_size:
                raise InputError(f"image: {im.width}x{im.height} is too elongated (its "
                                 f"{width}x{height} encoding size is outside "
                                 f"[{self.multiple}, {self.max_size}])", "image")
        super().validate(prompt, params, image)

    # ---- 1. prepare ------------------------------------------------------------------------

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator,
                image: Image.Image | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        if self.prompt_encoder is None:
            raise ValueError(f"this {self.label} stage loads no text encoder: its conditioning "
                             "comes from an upstream text-encoder stage")
        images = input_images(params, image)
        (encoded,) = self.prompt_encoder.encode_with_images([prompt], [params], [images])
        latents, sigmas, cond = self._latents(params, generator, images)
        return latents, sigmas, {**self.check_conditioning(encoded, params), **cond}

    def prepare_latents(self, params: DiffusionParams, generator: torch.Generator,
                        image: Image.Image | None = None
                        ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        return self._latents(params, generator, input_images(params, image))

    def _latents(self, params: DiffusionParams, generator: torch.Generator,
                 images: list[Image.Image]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """-> packed noise (n, N, 4C), sigmas, {"img_shapes" (1 + images, 3), "image_latents"
        (1, M, 4C)}: the input images encoded first (posterior means: no draw), then the
        noise, as diffusers."""
        tokens, shapes = [], []
        for im in images:
            width, height = self.vae_size(im)
            pixels = preprocess(im, height, width).unsqueeze(2)              # (1, 3, 1, H, W)
            z = self.vae.normalize(self.vae.encode(pixels.to(self.device, self.vae_dtype)))
            tokens.append(pack_latents(z[:, :, 0].to(self.dtype)))          # (1, M_i, 4C)
            shapes.append((1, height // self.multiple, width // self.multiple))
        n = params.num_images
        _, _, h, w, sigmas = self.latent_schedule(params, image=images[0])
        noise = torch.randn((n, self.num_channels_latents, h, w), generator=generator,
                            device=generator.device, dtype=self.dtype).to(self.device)
        img_shapes = torch.tensor([(1, h // 2, w // 2), *shapes])
        return pack_latents(noise), sigmas, {"img_shapes": img_shapes,
                                             "image_latents": torch.cat(tokens, dim=1)}

    # ---- 2. velocity -----------------------------------------------------------------------

    def img_shapes(self, request: DiffusionRequest) -> tuple[tuple[int, int, int], ...]:
        return tuple(tuple(s) for s in request.cond["img_shapes"].tolist())

    def model_input(self, latents: Tensor, branches: list[tuple[str, list[bool]]],
                    requests: list[DiffusionRequest], counts: list[int]) -> Tensor:
        """[latents | each row's input-image tokens] (rows, N + M, 4C)."""
        images = [r.cond["image_latents"].expand(n, -1, -1)
                  for _, present in branches
                  for r, n, here in zip(requests, counts, present) if here]
        return torch.cat([latents, torch.cat(images).to(latents.dtype)], dim=1)


class QwenImageEditPlusPipeline(QwenImageEditPipeline):
    label = "Qwen-Image-Edit-Plus"
    prompt_encoder_cls = QwenImageEditPlusPromptEncoder
    max_input_images = MAX_PLUS_IMAGES

