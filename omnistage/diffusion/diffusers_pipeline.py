"""The generic diffusers adapter's pipeline: a diffusers pipeline omnistage has no native port
of, loaded by diffusers (`DiffusionPipeline.from_pretrained`) and called whole.

A native pipeline (pipeline.py) hands the engine its phases so requests at different steps
share each transformer forward. diffusers' `__call__` runs encode, the whole denoising loop and
decode in one go, so the most this adapter can batch is one call over several prompts: requests
whose call arguments agree (`batch_key`: size, steps, guidance, images per prompt, whether a
negative prompt is given) run together, each with its own generator, so each request's seed
draws the image it draws alone. DiffusersEngine (diffusers_engine.py) does the batching.

Which pipelines it takes (`check_supported`, before any weight loads): a diffusers class with
a text `prompt` whose output is images. Audio, 3D, depth, embeddings (priors) and video are
refused naming the class: video (`frames`) would need /v1/videos' spec of the model, which a
generic adapter cannot know.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import sys
import typing
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from omnistage.diffusion.params import DiffusionParams, check_size
from omnistage.diffusion.pipeline import DiffusionPipeline
from omnistage.errors import InputError

logger = logging.getLogger(__name__)

BACKEND = "diffusers"
# DiffusionParams the adapter passes on -> the `__call__` argument each needs
CALL_ARGS = {"height": "height", "width": "width", "guidance_scale": "guidance_scale",
             "negative_prompt": "negative_prompt", "num_images": "num_images_per_prompt"}
# DiffusionParams only native pipelines take (their defaults: unset)
NATIVE_ONLY = ("guidance_scale_2", "cache_threshold", "image", "strength", "num_frames", "fps",
               "lora")
# output fields (of the pipeline's output dataclass) by what they hold
OUTPUT_KINDS = {"images": "images", "image": "images", "frames": "video", "video": "video",
                "audios": "audio", "audio": "audio", "sound": "audio"}
MAX_SIZE = 4096     # pixels a side: a bound on memory, as the native pipelines' max_size
THREE_D = ("ShapEPipeline", "ShapEImg2ImgPipeline")    # `images` that are renders of a 3D asset

OnStep = Callable[[int, int], None]     # (steps done, steps in all)


def check_supported(class_name: str) -> type:
    """The diffusers pipeline class `class_name`, if the adapter can serve it: ValueError
    naming the class otherwise (not in diffusers, no text prompt, output not images)."""
    try:
        import diffusers
    except ImportError:
        raise ValueError(f"diffusers pipeline {class_name}: the generic diffusers adapter needs "
                         "the diffusers package (pip install 'omnistage[diffusers]')") from None
    cls = getattr(diffusers, class_name, None) if class_name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        raise ValueError(f"diffusers pipeline {class_name!r}: diffusers {diffusers.__version__} "
                         "has no such pipeline class")
    if class_name in THREE_D:
        raise ValueError(f"diffusers pipeline {class_name}: it makes 3D assets; the generic "
                         "diffusers adapter serves pipelines that output images")
    if "prompt" not in inspect.signature(cls.__call__).parameters:
        raise ValueError(f"diffusers pipeline {class_name}: it takes no text prompt; the generic "
                         "diffusers adapter serves text-to-image pipelines")
    kinds = output_kinds(cls)
    if kinds != {"images"}:
        what = ", ".join(sorted(kinds - {"images"})) or "no images it can tell"
        raise ValueError(f"diffusers pipeline {class_name}: it outputs {what}; the generic "
                         "diffusers adapter serves pipelines that output images only")
    return cls


def output_kinds(cls: type) -> set[str]:
    """What a pipeline's output dataclass holds ("images", "video", "audio", "other" per
    field): from `__call__`'s return annotation, else from the output classes its module
    defines or imports (older pipelines are not annotated)."""
    from diffusers.utils import BaseOutput

    annotation = inspect.signature(cls.__call__).return_annotation
    outputs = [a for a in (typing.get_args(annotation) or (annotation,))
               if isinstance(a, type) and issubclass(a, BaseOutput)]
    if not outputs:
        outputs = [v for v in vars(sys.modules[cls.__module__]).values()
                   if isinstance(v, type) and issubclass(v, BaseOutput) and v is not BaseOutput]
    fields = {f.name for o in outputs for f in dataclasses.fields(o)}
    fields -= {"nsfw_content_detected", "nsfw_detected", "watermark_detected"}  # beside images
    return {OUTPUT_KINDS.get(name, "other") for name in fields}


def pipeline_class_name(path: str | Path) -> str:
    index = Path(path) / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{path}: no model_index.json (not a diffusers pipeline)")
    return json.loads(index.read_text()).get("_class_name") or "(none)"


class DiffusersPipeline(DiffusionPipeline):
    """A loaded diffusers pipeline and what its `__call__` takes; `run` makes the images of a
    batch of requests whose `batch_key`s are equal. Not stepped by our engine: its
    `backend` gives it a stage of its own (stages/diffusers.py, DiffusersEngine)."""

    label = "generic diffusers adapter"
    backend = BACKEND

    def __init__(self, pipe: object, device: torch.device) -> None:
        self.pipe = pipe
        self.device = device
        self.class_name = type(pipe).__name__
        self.call_args = set(inspect.signature(type(pipe).__call__).parameters)
        # every diffusers image pipeline needs its sides to be multiples of the VAE's factor
        self.size_multiple = int(getattr(pipe, "vae_scale_factor", 1) or 1)

    @classmethod
    def from_pretrained(cls, path: str | Path, component: str, device: torch.device,
                        dtype: torch.dtype | None) -> DiffusersPipeline:
        """As every diffusion component is loaded (`component`: the stage's, unused). The
        folder's pipeline class is checked first (no weights load for one the adapter
        refuses); then diffusers loads it in `dtype` (None: float32 on CPU, bfloat16 on CUDA,
        as diffusers' pipelines are run there) and moves it to `device`."""
        class_name = pipeline_class_name(path)
        check_supported(class_name)
        import diffusers

        logger.warning("%s: %s has no native omnistage port; serving it through the generic "
                       "diffusers adapter (NOT native: diffusers runs each call whole; requests "
                       "batch per call by size and steps, without step-level batching)",
                       path, class_name)
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        pipe = diffusers.DiffusionPipeline.from_pretrained(str(path), dtype=dtype)
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, device)

    def validate(self, prompt: str | None, params: DiffusionParams) -> None:
        """InputError naming a field this pipeline's call cannot take."""
        if prompt is None:
            raise ValueError(f"{self.class_name} (generic diffusers adapter) encodes its own "
                             "prompts: it cannot take conditioning from an upstream stage")
        for name in NATIVE_ONLY:
            if getattr(params, name) is not None:
                raise InputError(f"DiffusionParams.{name}: not supported by {self.class_name} "
                                 "(served by the generic diffusers adapter: text to image)", name)
        if params.true_cfg_scale != 1.0:
            raise InputError(f"DiffusionParams.true_cfg_scale: not supported by "
                             f"{self.class_name} (generic diffusers adapter)", "true_cfg_scale")
        for name, arg in CALL_ARGS.items():
            value = getattr(params, name)
            given = value != 1 if name == "num_images" else value is not None
            if given and arg not in self.call_args:
                raise InputError(f"DiffusionParams.{name}: {self.class_name}'s call takes no "
                                 f"{arg}", name)
        unset = self.size_multiple          # an unset side is the pipeline's default: passes
        check_size(params.height or unset, params.width or unset, self.size_multiple, MAX_SIZE,
                   f"{self.class_name}'s VAE factor")

    @staticmethod
    def batch_key(params: DiffusionParams) -> tuple:
        """Requests with equal keys can share one call: every argument but the prompt, the
        negative prompt and the generator is one value per call."""
        return (params.height, params.width, params.num_inference_steps,
                params.guidance_scale, params.num_images, params.negative_prompt is None)

    def run(self, prompts: list[str], params: list[DiffusionParams], seeds: list[int],
            on_step: OnStep) -> list[Tensor]:
        """One diffusers call over the requests (equal `batch_key`s) -> each one's images,
        uint8 (num_images, H, W, 3). `on_step(done, total)` after each denoising step."""
        first = params[0]
        kw = {CALL_ARGS[n]: getattr(first, n) for n in ("height", "width", "guidance_scale")
              if getattr(first, n) is not None}
        if first.num_images != 1:
            kw["num_images_per_prompt"] = first.num_images
        if first.negative_prompt is not None:
            kw["negative_prompt"] = [p.negative_prompt for p in params]
        # one generator per request, repeated for its images: its seed draws what it draws alone
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        kw["generator"] = [g for g in generators for _ in range(first.num_images)]
        out = self.pipe(prompt=prompts, num_inference_steps=first.num_inference_steps,
                        output_type="np", **kw, **self._progress(on_step, first))
        images = getattr(out, "images", None)
        images = getattr(out, "image", None) if images is None else images
        return list(to_uint8(images).split(first.num_images))

    def _progress(self, on_step: OnStep, params: DiffusionParams) -> dict[str, object]:
        """The call's per-step callback arguments: `callback_on_step_end` (its step index
        counts the scheduler's timesteps), else the older `callback` (counts steps)."""
        if "callback_on_step_end" in self.call_args:
            def on_end(pipe: object, i: int, t: object, kw: dict) -> dict:
                total = getattr(pipe, "num_timesteps", None) or params.num_inference_steps
                on_step(i + 1, total)
                return kw
            return {"callback_on_step_end": on_end}
        if "callback" in self.call_args:
            def callback(i: int, t: object, latents: Tensor) -> None:
                on_step(i + 1, params.num_inference_steps)
            return {"callback": callback, "callback_steps": 1}
        return {}


def to_uint8(images: object) -> Tensor:
    """A pipeline's images (float numpy in [0, 1] as output_type="np" gives them, or PIL
    images where a pipeline ignores it) -> uint8 (n, H, W, 3), rounded as diffusers'
    `numpy_to_pil` does."""
    if isinstance(images, np.ndarray) and images.dtype != np.uint8:
        array = (images * 255).round().astype(np.uint8)
    elif isinstance(images, list) and images and isinstance(images[0], Image.Image):
        array = np.stack([np.asarray(im.convert("RGB")) for im in images])
    else:
        raise TypeError(f"a diffusers pipeline returned {type(images).__name__} where images "
                        "were expected")
    if array.ndim == 3:
        array = array[..., None].repeat(3, axis=-1)      # grayscale
    return torch.from_numpy(np.ascontiguousarray(array))
