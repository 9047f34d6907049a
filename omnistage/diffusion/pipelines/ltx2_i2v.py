"""LTX-2 image-to-video with sound: diffusers' `LTX2ImageToVideoPipeline.__call__`, which is
the text-to-video loop (ltx2.py) with the first latent frame given:

    prepare:  the image re-compressed as one H.264 frame at `image_crf` (33, LTX-2's training
              compression; 0: as it is), resized to the video's size (bilinear), VAE-encoded
              (the posterior mean), normalized by the VAE's statistics; the video noise drawn
              after it, its first latent frame replaced by the image's
    velocity: the video tokens' timestep is the row's except the first frame's, 0 (audio:
              the row's); guidance as text-to-video; the first frame's velocity 0, so the
              solver leaves it as it is (diffusers steps only the frames after it)

Everything else (guidance, audio, decode, options) is ltx2.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from omnistage.diffusion.image_input import input_image, preprocess
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.ltx2 import SPEC, Layout, LTX2Options, LTX2Pipeline
from omnistage.diffusion.pipelines.ltx2 import video_spec as t2v_spec
from omnistage.registry import VideoSpec

I2V_SPEC = dataclasses.replace(SPEC, text_to_video=False, image_to_video=True)


@dataclass(frozen=True, slots=True)
class LTX2I2VOptions(LTX2Options):
    """ltx2.py's options, and image_crf: the H.264 CRF the first frame is re-compressed at
    before encoding (diffusers' default for Gemma 3 checkpoints: 33; 0 skips it)."""

    image_crf: int = 33

    def __post_init__(self) -> None:
        LTX2Options.__post_init__(self)
        if not 0 <= self.image_crf <= 51:
            raise ValueError(f"image_crf={self.image_crf}: must be in [0, 51] (H.264 CRF)")


def video_spec(path: str | Path) -> VideoSpec:
    t2v_spec(path)
    return I2V_SPEC


def recompress(image: Image.Image, crf: int) -> Image.Image:
    """The image as one H.264 frame at `crf` decodes (libx264, veryfast, yuv420p, sides
    rounded down to even), as diffusers' `apply_image_conditioning_crf`; crf 0: unchanged."""
    if crf == 0:
        return image
    import av

    pixels = np.array(image.convert("RGB"))
    pixels = pixels[:pixels.shape[0] // 2 * 2, :pixels.shape[1] // 2 * 2]
    with BytesIO() as buf:
        container = av.open(buf, "w", format="mp4")
        try:
            stream = container.add_stream("libx264", rate=1,
                                          options={"crf": str(crf), "preset": "veryfast"})
            stream.height, stream.width = pixels.shape[:2]
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24").reformat(format="yuv420p")
            container.mux(stream.encode(frame))
            container.mux(stream.encode())
        finally:
            container.close()
        data = buf.getvalue()
    with BytesIO(data) as buf:
        container = av.open(buf)
        try:
            stream = next(s for s in container.streams if s.type == "video")
            decoded = next(container.decode(stream)).to_ndarray(format="rgb24")
        finally:
            container.close()
    return Image.fromarray(decoded)


class LTX2ImageToVideoPipeline(LTX2Pipeline):
    label = "LTX-2 image-to-video"
    Options = LTX2I2VOptions

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.options = LTX2I2VOptions()
        self.video = I2V_SPEC

    def configure(self, options: LTX2I2VOptions) -> None:
        if options.upsample:
            raise ValueError("diffusion.options.upsample: the two-stage recipe is run for "
                             "text-to-video only (ltx2.yaml's graph)")
        super().configure(options)

    def validate(self, prompt: str | None, params: DiffusionParams,
                 image: Image.Image | None = None) -> None:
        if image is None and params.image is None:
            raise ValueError("image: LTX-2 image-to-video needs a first frame, which the "
                             "request lacks (/v1/videos: input_reference)")
        super().validate(prompt, dataclasses.replace(params, image=None), None)

    def initial_video(self, lay: Layout, n: int, generator: torch.Generator,
                      params: DiffusionParams, image: Image.Image | None) -> Tensor:
        """Noise with its first latent frame the image's normalized latents (no scaling
        factor: diffusers' image-to-video normalizes with the default 1.0)."""
        image = recompress(input_image(params, image), self.options.image_crf)
        _, height, width, _ = self._shape(params)
        if image.size != (width, height):        # LTX-2's video processor: bilinear
            image = image.resize((width, height), resample=Image.Resampling.BILINEAR)
        pixels = preprocess(image, height, width).to(self.device, torch.float32)
        z = self.vae.encode(pixels.unsqueeze(2))                               # (1, C, 1, h, w)
        shape = (1, -1, 1, 1, 1)
        z = (z - self.vae.latents_mean.view(shape)) / self.vae.latents_std.view(shape)
        noise = torch.randn((n, lay.channels, *lay.grid), generator=generator)
        return torch.cat([z.cpu().expand(n, -1, -1, -1, -1), noise[:, :, 1:]], dim=2)

    def video_timesteps(self, lay: Layout, t: Tensor) -> Tensor:
        """(R, N): the row's timestep, 0 on the first latent frame's tokens."""
        first = lay.grid[1] * lay.grid[2]
        out = t[:, None].expand(-1, lay.grid[0] * first).clone()
        out[:, :first] = 0
        return out

    def fixed(self, lay: Layout, velocity: Tensor) -> Tensor:
        velocity[:, :lay.grid[1] * lay.grid[2] * lay.channels] = 0
        return velocity
