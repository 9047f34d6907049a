"""A toy video model with a sound track, for the video API's sound tests: the toy video model
(toy_video.py: frames known from the prompt, the seed and the size), whose decode also returns
a stereo waveform known from the seed and the clip's length, as LTX-2's pipeline returns its
vocoder's (one Payload: Video and AudioChunk (n, channels, samples) at SAMPLE_RATE):

    left  0.5 sin(2 pi f t),  right 0.3 sin(2 pi 1.5 f t + 1),  f = 200 + seed mod 400 Hz,
    t over num_frames / fps seconds.

Importing this module registers the "testing_video_audio" family (architecture
ToyVideoAudioModel, its VideoSpec with `audio`); `build_toy_video_audio(folder)` writes a
checkpoint folder and the graph to serve it with.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from omnistage.diffusion.params import DiffusionParams
from omnistage.payloads import AudioChunk, Payload, Video
from omnistage.registry import Component, ModelFamily, VideoSpec, register_family
from omnistage.testing.toy_video import SPEC as VIDEO_SPEC
from omnistage.testing.toy_video import ToyVideoPipeline, build_toy_video

ARCHITECTURE = "ToyVideoAudioModel"
SPEC = VideoSpec(default_size=VIDEO_SPEC.default_size, size_multiple=VIDEO_SPEC.size_multiple,
                 default_num_frames=VIDEO_SPEC.default_num_frames,
                 max_num_frames=VIDEO_SPEC.max_num_frames,
                 frame_multiple=VIDEO_SPEC.frame_multiple, frame_offset=VIDEO_SPEC.frame_offset,
                 fps=VIDEO_SPEC.fps, audio=True)
SAMPLE_RATE = 16000


def expected_sound(seed: int, num_frames: int, fps: float) -> np.ndarray:
    """What the toy plays: float32 (2, num_frames / fps * SAMPLE_RATE)."""
    t = np.arange(round(num_frames / fps * SAMPLE_RATE)) / SAMPLE_RATE
    f = 200 + seed % 400
    return np.stack([0.5 * np.sin(2 * np.pi * f * t),
                     0.3 * np.sin(2 * np.pi * 1.5 * f * t + 1)]).astype(np.float32)


class ToyVideoAudioPipeline(ToyVideoPipeline):
    def decode(self, latents: Tensor, params: DiffusionParams) -> Payload:  # type: ignore[override]
        """(1, F, H, W, 3) -> the video and its sound, one Payload (as LTX-2's decode)."""
        frames = super().decode(latents, params)
        wave = expected_sound(params.seed or 0, frames.shape[1], params.fps or SPEC.fps)
        return Payload(video=Video(frames),
                       audio=AudioChunk(torch.from_numpy(wave)[None], SAMPLE_RATE))


def build_toy_video_audio(folder: Path, step_delay_s: float = 0.0) -> tuple[Path, Path]:
    """The toy video's folder and graph, its config naming ToyVideoAudioModel."""
    checkpoint, graph = build_toy_video(folder, step_delay_s)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config,
                                                        "architectures": [ARCHITECTURE]}))
    graph.write_text(graph.read_text().replace("toy_video", "toy_video_audio"))
    return checkpoint, graph


register_family(ModelFamily(
    "testing_video_audio", architectures=(ARCHITECTURE,), video=SPEC,
    components=(Component("diffusion", "toy_video_audio", f"{__name__}:ToyVideoAudioPipeline"),)),
    module=__name__)
