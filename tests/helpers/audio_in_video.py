"""A video with its audio track, for Qwen-Omni's `use_audio_in_video`: an MP4 with both streams
(for the media loader and the server), and transformers' own Qwen-Omni processor built around
our tokenizer, feature extractor and image processor, its torchvision video processor replaced
by one that returns our video patches (the interleaving and the placeholder text are what the
golden tests compare, not the resize)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from PIL import Image

SPECIAL = (("audio_token", "<|audio_pad|>"), ("image_token", "<|image_pad|>"),
           ("video_token", "<|video_pad|>"), ("vision_bos_token", "<|vision_start|>"),
           ("vision_eos_token", "<|vision_end|>"), ("audio_bos_token", "<|audio_start|>"),
           ("audio_eos_token", "<|audio_end|>"))


def tone(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t)
            + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def frames(n: int, width: int = 32, height: int = 32, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
            for _ in range(n)]


def mp4_with_audio(num_frames: int = 20, fps: int = 10, audio_seconds: float | None = 2.0,
                   rate: int = 16000, width: int = 32, height: int = 16) -> bytes:
    """An MP4 (mpeg4 video; AAC audio of a 440 Hz tone, or none) whose frame i is grey 10*i."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        video = container.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio = None if audio_seconds is None else container.add_stream("aac", rate=rate)
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 10 * i, np.uint8),
                                               format="rgb24")
            for packet in video.encode(frame):
                container.mux(packet)
        for packet in video.encode(None):
            container.mux(packet)
        if audio is not None:
            wave = tone(audio_seconds, rate)[None, :]
            step = 1024
            for start in range(0, wave.shape[1], step):
                piece = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, start:start + step]),
                                                   format="flt", layout="mono")
                piece.sample_rate, piece.pts = rate, start
                for packet in audio.encode(piece):
                    container.mux(packet)
            for packet in audio.encode(None):
                container.mux(packet)
    return buf.getvalue()


class _OurVideoPatches:
    """Stands in for transformers' video processor: our patches and grids for the videos."""

    def __init__(self, processor: Any, inputs: Any) -> None:
        self.temporal_patch_size = processor.image_processor.temporal_patch_size
        self.merge_size = processor.spatial_merge_size
        self.inputs = inputs

    def __call__(self, videos: Any, **kwargs: Any) -> dict[str, Any]:
        return {"pixel_values_videos": self.inputs.pixel_values_videos,
                "video_grid_thw": self.inputs.video_grid_thw}


def hf_processor(cls: type, processor: Any, inputs: Any) -> Any:
    """transformers' `cls` (Qwen2_5OmniProcessor, Qwen3OmniMoeProcessor) over our pieces,
    its video processor returning `inputs`' video patches."""
    from transformers.processing_utils import ProcessorMixin

    tokenizer = processor.tokenizer
    for attr, token in SPECIAL:
        setattr(tokenizer, attr, token)
        setattr(tokenizer, attr + "_id", tokenizer.convert_tokens_to_ids(token))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda *args: None)
        return cls(image_processor=processor.image_processor,
                   video_processor=_OurVideoPatches(processor, inputs),
                   feature_extractor=processor.feature_extractor, tokenizer=tokenizer)
