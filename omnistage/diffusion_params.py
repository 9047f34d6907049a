"""Per-request parameters of a diffusion stage, checked at the boundary. On the bottom floor
beside sampling_params.py: the front door (engine/) builds them and every stage kind reads
them, so no floor above needs diffusion/ to name them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import msgspec

from omnistage.errors import InputError
from omnistage.ranges import MAX_SEED, Range, check_ranges, numeric_fields

MAX_STEPS = 200
MAX_IMAGES = 10
MAX_INPUT_IMAGES = 10           # input images of one edit (a pipeline may take fewer)
MAX_SIDE = 16384                # pixels, as the API's `size`
MAX_GUIDANCE = 100.0
MAX_FRAMES = 4096
MAX_LORA_SCALE = 100.0
DEFAULT_STRENGTH = 0.6          # diffusers' img2img pipelines' default


class ImageRef(msgspec.Struct, frozen=True):
    """Stands in for the input image of params on their way to a stage: the file travels
    beside them, through the stage connector, not in the control message (`detach_image`,
    `attach_image`). The params stay an image-to-image request's, so `strength` stays valid."""

    nbytes: int


@dataclass(frozen=True, slots=True)
class LoraRequest:
    """A request's LoRA adapter (diffusion/lora.py), vLLM-Omni's `lora` object: `name`, the
    adapter's name; `path`, its file or folder on the server (loaded on first use; None: one
    already loaded under `name`); `scale`, how much of it (diffusers' set_adapters weight)."""

    name: str
    path: str | None = None
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise InputError("lora.name: must be a non-empty string", "lora.name")
        if self.path is not None and (not isinstance(self.path, str) or not self.path):
            raise InputError("lora.path: must be a non-empty string", "lora.path")
        scale = Range(-MAX_LORA_SCALE, MAX_LORA_SCALE)
        if not scale.holds(self.scale):
            raise InputError(f"lora.scale={self.scale!r}: {scale.describe()}", "lora.scale")


@dataclass(frozen=True, slots=True)
class DiffusionParams:
    """height/width None: the pipeline's default size. guidance_scale: classifier-free
    guidance (or FLUX's distilled guidance), None: the pipeline's default. guidance_scale_2:
    Wan2.2 A14B's scale on its low-noise expert, None: guidance_scale. true_cfg_scale:
    Qwen-Image's true CFG with a negative prompt. cache_threshold: step caching (TeaCache-
    style), None = off. image: an encoded image file (PNG, JPEG, WebP, ...) to start from
    (image-to-image / edit), or a PIL image (kept as PNG); on the way to a stage an
    `ImageRef`. extra_images: the second and later input images of a multi-image edit
    (Qwen-Image-Edit-Plus), the same way, in order. strength: how much of its schedule runs,
    1.0 = from pure noise."""

    height: int | None = None
    width: int | None = None
    num_inference_steps: int = 20
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    true_cfg_scale: float = 1.0
    negative_prompt: str | None = None
    seed: int | None = None
    num_images: int = 1
    cache_threshold: float | None = None
    image: bytes | ImageRef | None = field(default=None, repr=False)
    strength: float | None = None
    num_frames: int | None = None
    fps: float | None = None
    extra_images: tuple[bytes | ImageRef, ...] = field(default=(), repr=False)
    # Wan2.2 A14B's expert switch (share of the training timesteps) and a flow-matching
    # scheduler's shift for this request; None: the checkpoint's (a pipeline that has no use
    # for one names it ignored: DiffusionPipeline.unused_params)
    boundary_ratio: float | None = None
    flow_shift: float | None = None
    # LTX-2's two-stage recipe (base at a smaller size -> latent upsampler -> refine) for this
    # request; None: the stage's `diffusion.options.upsample`
    upsample: bool | None = None
    # a LoRA adapter for this request's transformer forwards (diffusion/lora.py); None: none
    lora: LoraRequest | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "image", _image_file(self.image))
        object.__setattr__(self, "extra_images",
                           tuple(_image_file(x) for x in self.extra_images))
        self.validate()

    def guidance(self, default: float) -> float:
        return default if self.guidance_scale is None else self.guidance_scale

    def validate(self) -> None:
        """InputError naming the first bad field; every numeric one goes through its range."""
        check_ranges("DiffusionParams", self, _RANGES)
        if self.image is not None and not isinstance(self.image, (bytes, ImageRef)):
            raise InputError("DiffusionParams.image: must be the bytes of an encoded image file "
                             f"(PNG, JPEG, WebP, ...), got {type(self.image).__name__}", "image")
        if self.image is not None and not self.image:
            raise InputError("DiffusionParams.image: empty", "image")
        if self.extra_images and self.image is None:
            raise InputError("DiffusionParams.extra_images: given without a first `image`",
                             "image")
        for x in self.extra_images:
            if not isinstance(x, (bytes, ImageRef)) or not x:
                raise InputError("DiffusionParams.extra_images: each must be the non-empty "
                                 "bytes of an encoded image file", "image")
        if 1 + len(self.extra_images) > MAX_INPUT_IMAGES:
            raise InputError(f"DiffusionParams: {1 + len(self.extra_images)} input images, "
                             f"the maximum is {MAX_INPUT_IMAGES}", "image")
        if self.strength is not None and self.image is None:
            raise InputError(f"DiffusionParams.strength={self.strength!r}: applies to "
                             "image-to-image only (no image given)", "strength")

    def detach_image(self) -> tuple[DiffusionParams, list[bytes]]:
        """(these params with an `ImageRef` for each input image file, the files in order):
        what goes in the control message, and what goes through the connector. Without an
        image, (self, [])."""
        if not isinstance(self.image, bytes):
            return self, []
        files = [self.image, *self.extra_images]
        assert all(isinstance(f, bytes) for f in files), "an image detached twice"
        return replace(self, image=ImageRef(len(self.image)),
                       extra_images=tuple(ImageRef(len(f)) for f in files[1:])), files

    def attach_image(self, files: list[bytes]) -> DiffusionParams:
        """The params `detach_image` sent, with their image files back from the connector."""
        refs = [self.image, *self.extra_images]
        assert [r.nbytes if isinstance(r, ImageRef) else None for r in refs] == \
            [len(f) for f in files], f"image files of {[len(f) for f in files]} bytes for " \
            f"params expecting {refs!r}"
        return replace(self, image=files[0], extra_images=tuple(files[1:]))

    @property
    def image_strength(self) -> float:
        """The strength an image-to-image request runs with (diffusers' default 0.6)."""
        return DEFAULT_STRENGTH if self.strength is None else self.strength


# every numeric field: kind, finiteness and range (ranges.py). Guidance past 100 only
# overflows (1e39 made a whole batch's latents inf); no pipeline here is tuned beyond 20.
_RANGES = {
    "height": Range(1, MAX_SIDE, integer=True),
    "width": Range(1, MAX_SIDE, integer=True),
    "num_inference_steps": Range(1, MAX_STEPS, integer=True),
    "guidance_scale": Range(0.0, MAX_GUIDANCE),
    "guidance_scale_2": Range(0.0, MAX_GUIDANCE),
    "true_cfg_scale": Range(0.0, MAX_GUIDANCE),
    "seed": Range(0, MAX_SEED, integer=True),
    "num_images": Range(1, MAX_IMAGES, integer=True),
    "cache_threshold": Range(0.0, 100.0),
    "strength": Range(0.0, 1.0, lo_open=True),
    "num_frames": Range(1, MAX_FRAMES, integer=True),
    "fps": Range(0.0, 120.0, lo_open=True),
    "boundary_ratio": Range(0.0, 1.0, lo_open=True, hi_open=True),
    "flow_shift": Range(0.0, 100.0, lo_open=True),
}


def _image_file(image: object) -> object:
    """An input image as the bytes of its file: a PIL image saved as PNG, a bytearray copied;
    anything else as given (validate judges it)."""
    if isinstance(image, bytearray):
        return bytes(image)
    if image is not None and not isinstance(image, bytes) and hasattr(image, "save"):
        import io

        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()
    return image


assert numeric_fields(DiffusionParams) == set(_RANGES), \
    f"a numeric field without a range: {numeric_fields(DiffusionParams) ^ set(_RANGES)}"


def check_size(height: int, width: int, multiple: int, max_size: int, why: str) -> None:
    """A pipeline's size rule: both sides a multiple of `multiple` (`why` says whence) and at
    most `max_size`; ValueError naming the side otherwise."""
    for name, value in (("height", height), ("width", width)):
        if value % multiple:
            raise InputError(f"{name}={value}: must be a multiple of {multiple} ({why})", name)
        if value > max_size:
            raise InputError(f"{name}={value}: the maximum is {max_size}", name)
