"""An LTX-2 stage's options (`LTX2Options`), a request's latent row (`Layout`: its video
tokens and audio tokens side by side) and diffusers' guidance rescale, for ltx2.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from omnistage.diffusion.pipelines.ltx2_two_stage import SCHEDULES
from omnistage.models.ltx2_transformer import Positions


@dataclass(frozen=True, slots=True)
class LTX2Options:
    """An LTX-2 stage's `diffusion.options`: the scales diffusers' `__call__` takes besides
    guidance_scale, with its defaults. audio_guidance_scale: CFG on the audio; modality_scale /
    audio_modality_scale > 1: modality guidance (one more forward without audio-video
    attention); guidance_rescale / audio_guidance_rescale: how far the guided x0 is pulled
    back to the conditional one's std (0: not at all). schedule "distilled": the distilled
    checkpoints' 8 sigmas, video guidance 1 by default; upsample: the two-stage recipe
    (base, the folder's latent_upsampler/, refine: ltx2_two_stage.py). stg_scale /
    audio_stg_scale > 0: spatio-temporal guidance, one more forward with the self-attentions
    of `stg_blocks` skipped (a transformer whose config has perturbed_attn; none otherwise,
    where diffusers' pass equals the conditional one)."""

    audio_guidance_scale: float = 7.0
    modality_scale: float = 3.0
    audio_modality_scale: float = 3.0
    guidance_rescale: float = 0.7
    audio_guidance_rescale: float = 0.7
    schedule: str = "default"
    upsample: bool = False
    stg_scale: float = 1.0
    audio_stg_scale: float = 1.0
    stg_blocks: tuple[int, ...] = (28,)

    def __post_init__(self) -> None:
        for name in ("audio_guidance_scale", "modality_scale", "audio_modality_scale",
                     "guidance_rescale", "audio_guidance_rescale", "stg_scale",
                     "audio_stg_scale"):
            value = getattr(self, name)
            if not 0.0 <= value <= 100.0:
                raise ValueError(f"{name}={value}: must be in [0, 100]")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: one of {SCHEDULES}")

    @property
    def modality(self) -> bool:
        return self.modality_scale > 1.0 or self.audio_modality_scale > 1.0


def rescale(guided: Tensor, cond: Tensor, factor: float) -> Tensor:
    """diffusers' rescale_noise_cfg over rows (n, ...): guided pulled to cond's std by factor."""
    if factor <= 0:
        return guided
    dims = list(range(1, guided.dim()))
    scaled = guided * (cond.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return factor * scaled + (1 - factor) * guided


@dataclass(frozen=True, slots=True)
class Layout:
    """One request's latent row: N video tokens of C features on a (F', H', W') grid, then
    T audio tokens of Ca features; `positions` what the transformer's rope needs."""
    grid: tuple[int, int, int]
    channels: int
    audio_frames: int
    audio_channels: int
    fps: float

    @property
    def video_size(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2] * self.channels

    @property
    def positions(self) -> Positions:
        return Positions(self.grid, self.fps, self.audio_frames)

    def split(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """rows (R, S) -> video (R, N, C), audio (R, T, Ca)."""
        r = rows.shape[0]
        return (rows[:, :self.video_size].reshape(r, -1, self.channels),
                rows[:, self.video_size:].reshape(r, self.audio_frames, self.audio_channels))

    @staticmethod
    def join(video: Tensor, audio: Tensor) -> Tensor:
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)
