"""Tiny random HunyuanVideo-1.5 parts built with diffusers' and transformers' own classes and
saved with `save_pretrained` (the Hub layout): the VAE, and the two prompt encoders with their
tokenizers, for the golden tests of our VAE, our prompt encoding and the pipeline."""

from __future__ import annotations

from pathlib import Path

import torch

LATENT_CHANNELS = 4
# 8x in space (block 0 halves H and W only, blocks 1 and 2 also T), 4x in time
TINY_VAE = dict(in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
                block_out_channels=[8, 16, 16, 32], layers_per_block=1,
                spatial_compression_ratio=8, temporal_compression_ratio=4,
                scaling_factor=0.8)


def perturb_gammas(model: torch.nn.Module) -> None:
    """RMS gammas start at one: move them so that their layout matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.add_(torch.randn_like(p) * 0.2)


def build_tiny_vae(path: Path | None = None, **overrides: object):  # -> AutoencoderKLHunyuanVideo15
    """diffusers' AutoencoderKLHunyuanVideo15 with `TINY_VAE` (+ overrides), seed 0, saved to
    `path` when given; -> the reference model (eval, float32)."""
    import diffusers

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLHunyuanVideo15(**{**TINY_VAE, **overrides}).eval()
    perturb_gammas(vae)
    if path is not None:
        vae.save_pretrained(path)
    return vae
