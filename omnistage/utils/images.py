"""Image encoding for the API: PIL images or uint8 tensors to PNG / JPEG / WebP bytes, and
base64 for JSON responses."""

from __future__ import annotations

import base64
import io

from PIL import Image
from torch import Tensor

from omnistage.errors import InputError

FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}
MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}
MAX_INPUT_PIXELS = 4096 * 4096       # decompression-bomb guard for input images


def to_pil(image: Image.Image | Tensor) -> Image.Image:
    """A PIL image, or a uint8 tensor (H, W, C) with C in {1, 3, 4}."""
    if isinstance(image, Image.Image):
        return image
    if image.dtype.is_floating_point or image.dim() != 3 or image.shape[-1] not in (1, 3, 4):
        raise ValueError(f"expected a uint8 image tensor (H, W, 1|3|4), got {image.dtype} "
                         f"{tuple(image.shape)}")
    array = image.cpu().numpy()
    return Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array)


def encode_image(image: Image.Image | Tensor, fmt: str = "png", quality: int = 90) -> bytes:
    """Encode as png, jpeg or webp (quality 1-100 for the lossy ones)."""
    name = FORMATS.get(fmt.lower())
    if name is None:
        raise ValueError(f"output_format={fmt!r}: choose png, jpeg or webp")
    if not 1 <= quality <= 100:
        raise ValueError(f"output_compression={quality}: must be in [1, 100]")
    pil = to_pil(image)
    if name == "JPEG" and pil.mode not in ("L", "RGB"):
        pil = pil.convert("RGB")  # JPEG has no alpha
    buf = io.BytesIO()
    pil.save(buf, format=name, **({} if name == "PNG" else {"quality": quality}))
    return buf.getvalue()


def encode_image_b64(image: Image.Image | Tensor, fmt: str = "png", quality: int = 90) -> str:
    return base64.b64encode(encode_image(image, fmt, quality)).decode("ascii")


def mime_type(fmt: str) -> str:
    return MIME[FORMATS[fmt.lower()]]


def peek_image(data: bytes, max_pixels: int = MAX_INPUT_PIXELS) -> Image.Image:
    """The image file opened from its header alone (format and size; the pixels are not
    decoded): InputError naming `image` for no bytes, an unknown format, or more than
    `max_pixels`. Here, below the front door, so that engine/ checks an input image without
    the diffusion engine."""
    if not data:
        raise InputError("image: empty", "image")
    try:
        image = Image.open(io.BytesIO(data))
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ...
        raise InputError(f"image: cannot be decoded as an image file ({type(exc).__name__}: "
                         f"{exc})", "image") from None
    width, height = image.size
    if width * height > max_pixels:
        raise InputError(f"image: {width}x{height} is larger than the maximum of "
                         f"{max_pixels} pixels", "image")
    return image
