"""The image VAE of FLUX.2: diffusers' `AutoencoderKLFlux2`, which is `AutoencoderKL`
(autoencoder_kl.py: same encoder, decoder and quant convs, 32 latent channels) with a
batch-norm style normalisation of 2x2 latent patches in place of a scale and shift:

    raw latents (B,C,h,w) --patchify--> (B,4C,h/2,w/2) --(x - running_mean) / sqrt(running_var
    + eps)--> the transformer's space; `denormalize` undoes both.

Patch channels are ordered (c, dy, dx), so flattening the patch grid gives FLUX.1's packed
tokens. The statistics are the checkpoint's `bn.running_mean` / `bn.running_var` (the
BatchNorm is never trained here; its `num_batches_tracked` counter is skipped).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from omnistage.models.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig


@dataclass(frozen=True, slots=True)
class AutoencoderKLFlux2Config(AutoencoderKLConfig):
    latent_channels: int = 32
    decoder_block_out_channels: tuple[int, ...] | None = None
    batch_norm_eps: float = 1e-4
    batch_norm_momentum: float = 0.1        # training only; kept so config.json parses
    patch_size: tuple[int, ...] = (2, 2)

    def __post_init__(self) -> None:
        AutoencoderKLConfig.__post_init__(self)
        if tuple(self.patch_size) != (2, 2):
            raise ValueError(f"patch_size {self.patch_size}: FLUX.2 pipelines pack 2x2 patches")

    @property
    def decoder_channels(self) -> tuple[int, ...]:
        return self.decoder_block_out_channels or self.block_out_channels


class LatentBatchNorm(nn.Module):
    """The frozen statistics of diffusers' `bn` (BatchNorm2d, affine=False), as parameters so
    the strict loader fills and checks them."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.running_mean = nn.Parameter(torch.zeros(channels), requires_grad=False)
        self.running_var = nn.Parameter(torch.ones(channels), requires_grad=False)


class AutoencoderKLFlux2(AutoencoderKL):
    config_cls = AutoencoderKLFlux2Config
    ignored_tensors = ("num_batches_tracked",)

    def __init__(self, cfg: AutoencoderKLFlux2Config) -> None:
        super().__init__(cfg)
        self.bn = LatentBatchNorm(4 * cfg.latent_channels)

    def _stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        mean = self.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(self.bn.running_var.view(1, -1, 1, 1) + self.cfg.batch_norm_eps)
        return mean, std.to(like.device, like.dtype)

    def normalize(self, latents: Tensor) -> Tensor:
        """raw (B, C, h, w) -> normalized patches (B, 4C, h/2, w/2)."""
        mean, std = self._stats(latents)
        return (patchify(latents) - mean) / std

    def denormalize(self, latents: Tensor) -> Tensor:
        """normalized patches (B, 4C, h/2, w/2) -> raw (B, C, h, w)."""
        mean, std = self._stats(latents)
        return unpatchify(latents * std + mean)


def patchify(latents: Tensor) -> Tensor:
    """(B, C, h, w) -> (B, 4C, h/2, w/2), channel c*4 + dy*2 + dx."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return latents.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: Tensor) -> Tensor:
    """(B, 4C, h/2, w/2) -> (B, C, h, w), the inverse of `patchify`."""
    b, c4, h, w = latents.shape
    latents = latents.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return latents.reshape(b, c4 // 4, h * 2, w * 2)
