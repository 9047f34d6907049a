"""Input images of image-to-image / edit requests: bytes -> checked PIL image -> the tensor a
VAE encodes, as diffusers' `VaeImageProcessor.preprocess` makes it (PIL Lanczos resize to the
target size, [0, 255] -> [-1, 1]).

A request's image arrives as encoded bytes (PNG, JPEG, WebP, ...) and stays encoded, small,
until the stage that draws from it: the front door reads only its header (`peek_image`), the
orchestrator puts the file in the stage connector (`file_tensor`) and sends its params with an
`ImageRef` instead, and the stage attaches it again (`file_bytes`). It is decoded once, by the
diffusion engine when the request is added; the pipeline's `validate` / `prepare` take that
image (`image=`), and a pipeline's size rule reads the decoded image or the file's header.

    front door          orchestrator                         diffusion stage
    peek_image(file) -> connector.put(StageInputs.of_files(files)) -> attach_image(image_files(...))
                        AddRequest(params + ImageRef,        -> engine: decode_image, once
                                   inputs=handle)
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from omnistage.diffusion.params import DiffusionParams
from omnistage.errors import InputError
from omnistage.payloads import (StageInputs, file_bytes,
                                input_image_files)
from omnistage.utils.images import MAX_INPUT_PIXELS, peek_image   # (re-exported)
from omnistage.diffusion.solvers.flow_match_euler import scale_noise, timesteps_for_strength


def image_inputs(files: list[bytes]) -> dict[str, Tensor]:
    """A request's input image files as the stage inputs they travel as (a packed
    payloads.StageInputs)."""
    return StageInputs.of_files(files).pack()


def image_files(multimodal: dict[str, Tensor]) -> list[bytes]:
    """The files `image_inputs` sent, in order, from a stage's multimodal inputs."""
    return [file_bytes(t) for t in input_image_files(multimodal)]


def decode_image(data: bytes, max_pixels: int = MAX_INPUT_PIXELS) -> Image.Image:
    """Encoded image bytes -> an RGB PIL image; InputError naming `image` if it cannot be
    decoded or is larger than `max_pixels`."""
    image = peek_image(data, max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
    except Exception as exc:  # PIL raises OSError, SyntaxError, ... on truncated data
        raise InputError(f"image: cannot be decoded as an image file ({type(exc).__name__}: "
                         f"{exc})", "image") from None
    if image.mode != "RGB":
        image = image.convert("RGB")
    return image


def input_image(params: DiffusionParams, image: Image.Image | None) -> Image.Image | None:
    """A request's input image: the one decoded already (`image`, the engine's), else its
    params' bytes decoded here (a pipeline called directly), else None (text-to-image)."""
    if image is not None or params.image is None:
        return image
    return decode_image(params.image)


def input_images(params: DiffusionParams, image: Image.Image | None = None
                 ) -> list[Image.Image]:
    """Every input image of a request, decoded, in order (the first: `image`, where the engine
    decoded it already); [] without one. What a pipeline taking several (`max_input_images`:
    Qwen-Image-Edit-Plus, FLUX.2) conditions on."""
    first = input_image(params, image)
    return [] if first is None else [first, *map(decode_image, params.extra_images)]


def opened_images(params: DiffusionParams, image: Image.Image | None = None
                  ) -> list[Image.Image]:
    """`input_images` opened from their headers only (sizes, no pixels): what a size rule or
    a check needs. The first is `image` where the engine decoded it."""
    if params.image is None:
        return []
    first = image if image is not None else peek_image(params.image)
    return [first, *map(peek_image, params.extra_images)]


def default_size(image: Image.Image, multiple: int) -> tuple[int, int]:
    """(height, width) of an input image rounded down to `multiple`: the output size of an
    image-to-image request that gives none."""
    width, height = image.size
    if width < multiple or height < multiple:
        raise ValueError(f"image: {width}x{height} is smaller than the model's minimum "
                         f"{multiple}x{multiple}")
    return height - height % multiple, width - width % multiple


def preprocess(image: Image.Image, height: int, width: int) -> Tensor:
    """PIL image -> (1, 3, height, width) float32 in [-1, 1]; resized with Lanczos when its
    size differs (diffusers' default `resample`)."""
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.Resampling.LANCZOS)
    pixels = np.asarray(image, dtype=np.float32) / 255.0                  # (H, W, 3)
    return torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0) * 2.0 - 1.0


def output_size(height: int | None, width: int | None, image: Image.Image | bytes | None,
                multiple: int, default: int) -> tuple[int, int]:
    """A request's output (height, width): as asked; else, with an input image (decoded, or
    its file's header read), the image's size rounded down to `multiple`; else the
    pipeline's `default`."""
    if image is not None and (height is None or width is None):
        opened = peek_image(image) if isinstance(image, bytes) else image
        image_h, image_w = default_size(opened, multiple)
        return height or image_h, width or image_w
    return height or default, width or default


def image_to_image(params: DiffusionParams, sigmas: Tensor, height: int, width: int,
                   image: Image.Image | None = None) -> tuple[Tensor, Tensor] | None:
    """What image-to-image shares across pipelines, before each encodes with its own VAE: the
    schedule shortened by the request's strength, and its image (`input_image`) as the tensor
    a VAE encodes (1, 3, height, width). None for text-to-image."""
    image = input_image(params, image)
    if image is None:
        return None
    start = timesteps_for_strength(params.num_inference_steps, params.image_strength)
    return sigmas[start:], preprocess(image, height, width)


def noised_image(image_latents: Tensor, sigma: Tensor, noise: Tensor) -> Tensor:
    """The encoded image (1, C, h, w) noised to `sigma`, once per row of `noise` (n, C, h, w):
    image-to-image's starting latents."""
    return scale_noise(image_latents.expand(noise.shape[0], -1, -1, -1), sigma, noise)
