"""DiffusionParams' input images: a multi-image edit's files detach into ImageRefs for the
control message and travel as "mm.image", "mm.image.1", ... beside it, back in order."""

from __future__ import annotations

import pytest
from PIL import Image

from omnistage.diffusion.image_input import image_files, image_inputs
from omnistage.diffusion.params import DiffusionParams, ImageRef
from omnistage.errors import InputError


def test_several_images_detach_and_attach_in_order() -> None:
    files = [b"first file", b"second", b"third one"]
    params = DiffusionParams(image=files[0], extra_images=(files[1], bytearray(files[2])))
    sent, detached = params.detach_image()
    assert detached == files
    assert sent.image == ImageRef(10) and sent.extra_images == (ImageRef(6), ImageRef(9))
    inputs = image_inputs(detached)
    assert list(inputs) == ["mm.image", "mm.image.1", "mm.image.2"]
    back = image_files({k.removeprefix("mm."): v for k, v in inputs.items()})
    assert sent.attach_image(back) == params


def test_extra_images_are_checked() -> None:
    with pytest.raises(InputError, match="without a first `image`"):
        DiffusionParams(extra_images=(b"x",))
    with pytest.raises(InputError, match="non-empty"):
        DiffusionParams(image=b"x", extra_images=(b"",))
    with pytest.raises(InputError, match="the maximum is 10"):
        DiffusionParams(image=b"x", extra_images=(b"x",) * 10)
    png = DiffusionParams(image=b"x", extra_images=(Image.new("RGB", (4, 4)),)).extra_images[0]
    assert png.startswith(b"\x89PNG")                          # a PIL image: as its PNG file
