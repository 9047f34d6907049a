"""Image encoding round trips."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.utils.images import encode_image, encode_image_b64, mime_type


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_png_is_lossless(channels: int) -> None:
    pixels = torch.randint(0, 256, (16, 24, channels), dtype=torch.uint8)
    back = Image.open(io.BytesIO(encode_image(pixels, "png")))
    assert back.size == (24, 16)
    got = torch.from_numpy(np.array(back))
    assert torch.equal(got.reshape(16, 24, channels), pixels)


@pytest.mark.parametrize("fmt, magic", [("jpeg", b"\xff\xd8"), ("webp", b"RIFF"),
                                        ("PNG", b"\x89PNG")])
def test_formats_and_b64(fmt: str, magic: bytes) -> None:
    pixels = torch.full((8, 8, 4), 200, dtype=torch.uint8)  # alpha: JPEG drops it
    data = encode_image(pixels, fmt, quality=80)
    assert data.startswith(magic)
    assert base64.b64decode(encode_image_b64(pixels, fmt))[:2] == magic[:2]
    assert mime_type(fmt).startswith("image/")


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="output_format"):
        encode_image(torch.zeros(4, 4, 1, dtype=torch.uint8), "gif")
    with pytest.raises(ValueError, match="output_compression"):
        encode_image(torch.zeros(4, 4, 1, dtype=torch.uint8), "jpeg", quality=0)
    with pytest.raises(ValueError, match="uint8 image tensor"):
        encode_image(torch.zeros(4, 4, 1), "png")
