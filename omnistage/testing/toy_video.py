"""A toy video model for the video API's tests: a diffusion pipeline whose denoising lands
exactly on frames that depend only on the prompt, the seed, the size, the frame count and
the first-frame image, in a few steps that the engine batches and reports progress for:

    prepare   latents = noise (1, F, H, W, 3), cond target = expected_frames(...)
    velocity  (x - target) / sigma: each Euler step keeps x = target + sigma * (noise - target)
    decode    x at sigma 0 = target, rounded to uint8 (1, F, H, W, 3) -> tensors["video"]

The frames: a background whose colour comes from the prompt (for image-to-video, the input
image's mean colour) and a square of the seed's colour moving one step to the right each
frame: at most two colours a frame, so even GIF keeps them exactly, and every frame differs
from the one before. A prompt starting with "fail" makes the denoiser raise (a generation
failing mid-run, as out of memory would). The checkpoint's config.json may set
`step_delay_s`, a sleep in each step, so that tests catch jobs running.

Importing this module registers the "testing_video" family (architecture ToyVideoModel,
component toy_video, its VideoSpec); the production table in omnistage/registry.py knows
nothing of it. `build_toy_video(folder)` writes a checkpoint folder and the graph to serve it
with.
"""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from omnistage.diffusion.image_input import input_image, peek_image
from omnistage.diffusion.params import DiffusionParams, check_size
from omnistage.diffusion.pipeline import DiffusionPipeline
from omnistage.diffusion.request import DiffusionRequest
from omnistage.registry import Component, ModelFamily, VideoSpec, register_family

ARCHITECTURE = "ToyVideoModel"
SPEC = VideoSpec(default_size=(64, 48), size_multiple=16, default_num_frames=9,
                 max_num_frames=33, frame_multiple=4, frame_offset=1, fps=8,
                 image_to_video=True)
MAX_SIZE = 256
NOISE_SCALE = 64.0


def _colour(key: int) -> np.ndarray:
    return np.array([key & 0xFF, (key >> 8) & 0xFF, (key >> 16) & 0xFF], dtype=np.uint8)


def expected_frames(prompt: str, seed: int, num_frames: int, height: int, width: int,
                    image: Image.Image | None = None) -> np.ndarray:
    """What the toy draws: uint8 (F, H, W, 3) (see the module docstring)."""
    if image is not None:
        background = np.asarray(image.convert("RGB"), dtype=np.float64).mean(axis=(0, 1))
        background = background.round().astype(np.uint8)
    else:
        background = _colour(zlib.crc32(prompt.encode()))
    square = _colour(zlib.crc32(seed.to_bytes(8, "little")) | 0x808080)   # never too dark
    side = max(2, height // 4)
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    frames[:] = background
    for i in range(num_frames):
        left = (i * max(1, width // 16)) % (width - side + 1)
        frames[i, height // 2 - side // 2:height // 2 - side // 2 + side, left:left + side] = square
    return frames


class ToyVideoPipeline(DiffusionPipeline):
    def __init__(self, device: torch.device, step_delay_s: float = 0.0) -> None:
        self.device = device
        self.step_delay_s = step_delay_s

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str, device: torch.device,
                        dtype: torch.dtype | None) -> ToyVideoPipeline:
        config = json.loads((Path(path) / "config.json").read_text()) if path else {}
        return cls(device, float(config.get("step_delay_s", 0.0)))

    def _shape(self, params: DiffusionParams) -> tuple[int, int, int]:
        width, height = SPEC.default_size
        return (params.num_frames or SPEC.default_num_frames, params.height or height,
                params.width or width)

    def validate(self, prompt: str | None, params: DiffusionParams,
                 image: Image.Image | None = None) -> None:
        num_frames, height, width = self._shape(params)
        check_size(height, width, SPEC.size_multiple, MAX_SIZE, "the toy's rule")
        if not SPEC.valid_num_frames(num_frames):
            raise ValueError(f"num_frames={num_frames}: must be {SPEC.frame_rule}")
        if image is None and params.image is not None:
            peek_image(params.image)

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator,
                image: Image.Image | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        num_frames, height, width = self._shape(params)
        target = expected_frames(prompt, params.seed or 0, num_frames, height, width,
                                 input_image(params, image))
        noise = torch.randn(1, num_frames, height, width, 3, generator=generator) * NOISE_SCALE
        sigmas = torch.linspace(1.0, 0.0, params.num_inference_steps + 1)
        cond = {"target": torch.from_numpy(target).float()[None],
                "fail": torch.tensor(prompt.startswith("fail"))}
        return noise, sigmas, cond

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if any(bool(r.cond["fail"]) for r in requests):
            raise RuntimeError("the toy ran out of memory (a prompt starting with 'fail')")
        target = torch.cat([r.cond["target"] for r in requests]).to(latents.device)
        return (latents - target) / sigmas.view(-1, 1, 1, 1, 1)

    def decode(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        """(1, F, H, W, 3) pixel values -> uint8 video (1, F, H, W, 3)."""
        return latents.round().clamp(0, 255).to(torch.uint8).cpu()


def build_toy_video(folder: Path, step_delay_s: float = 0.0) -> tuple[Path, Path]:
    """A checkpoint folder (config.json naming ToyVideoModel, a placeholder weight file)
    and the stage graph to serve it with (`omnistage serve FOLDER --stage-config GRAPH`)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [ARCHITECTURE],
                                                    "step_delay_s": step_delay_s}))
    save_file({"unused": torch.zeros(1)}, folder / "model.safetensors")
    graph = folder / "graph.yaml"
    graph.write_text("""
stages:
  - name: video
    kind: diffusion
    component: toy_video
    final: video
""")
    return folder, graph


register_family(ModelFamily(
    "testing_video", architectures=(ARCHITECTURE,), video=SPEC,
    components=(Component("diffusion", "toy_video", f"{__name__}:ToyVideoPipeline"),)),
    module=__name__)
