"""Tiny random LTX-2 built with diffusers' own classes: the transformer alone
(`tiny_transformer`) and the whole `LTX2Pipeline` folder (`build_tiny_ltx2`: transformer,
connectors, video VAE, audio VAE, vocoder, scheduler; no Gemma text encoder, whose prompt
embeddings the tests give), saved with `save_pretrained` so our loaders read the Hub layout.

Sizes: video latents 8 channels at 8x spatial / 2x temporal (LTX-2's are 128 at 32x / 8x),
audio latents 4 channels x 4 mel bins (16 mel bins / 4), stereo, the vocoder at 8 kHz."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CAPTION = 12            # caption_channels: the connectors' output width
TEXT_LAYERS = 2         # Gemma hidden states stacked per token (text_proj_in_factor)
TRANSFORMER = dict(
    in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8,
    cross_attention_dim=16, audio_in_channels=16, audio_out_channels=16,
    audio_num_attention_heads=2, audio_attention_head_dim=6, audio_cross_attention_dim=12,
    num_layers=2, caption_channels=CAPTION, vae_scale_factors=(2, 8, 8), audio_scale_factor=4,
    audio_sampling_rate=16000, audio_hop_length=160)


def randomize(model: torch.nn.Module, std: float = 0.3) -> torch.nn.Module:
    """Every parameter from N(0, std): diffusers zero-inits none here, but its tables start
    at randn / sqrt(dim) and its RMSNorm weights at 1, which would hide a swapped one."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model


def tiny_transformer(**overrides: Any) -> torch.nn.Module:
    from diffusers import LTX2VideoTransformer3DModel
    torch.manual_seed(0)
    return randomize(LTX2VideoTransformer3DModel(**dict(TRANSFORMER, **overrides)).eval())


def tiny_connectors() -> torch.nn.Module:
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    torch.manual_seed(1)
    model = LTX2TextConnectors(
        caption_channels=CAPTION, text_proj_in_factor=TEXT_LAYERS,
        video_connector_num_attention_heads=2, video_connector_attention_head_dim=6,
        video_connector_num_layers=1, video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=6,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32, rope_theta=10000.0, rope_double_precision=True,
        causal_temporal_positioning=False, rope_type="interleaved")
    return randomize(model.eval(), 0.2)


def build_tiny_ltx2(path: Path) -> Any:
    """The tiny `LTX2Pipeline` saved at `path`; -> the reference pipeline (float32, CPU)."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video,
                           FlowMatchEulerDiscreteScheduler, LTX2Pipeline)
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    from tests.helpers.ltx2_vae import AUDIO_CONFIGS, VIDEO_CONFIGS, VOCODER_CONFIGS
    torch.manual_seed(2)
    vae = AutoencoderKLLTX2Video(**VIDEO_CONFIGS["ltx2"]).eval()
    audio = dict(AUDIO_CONFIGS["ltx2"], latent_channels=4)
    audio_vae = AutoencoderKLLTX2Audio(**audio).eval()
    vocoder = LTX2Vocoder(**VOCODER_CONFIGS["ltx2"]).eval()
    with torch.no_grad():
        for m in (vae, audio_vae, vocoder):
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        for key, b in (*vae.named_buffers(), *audio_vae.named_buffers()):
            if key.endswith("latents_std"):
                b.copy_(torch.rand_like(b) + 0.5)
            elif key.endswith("latents_mean"):
                b.copy_(torch.randn_like(b) * 0.3)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1)
    pipe = LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=None,
                        tokenizer=None, connectors=tiny_connectors(),
                        transformer=tiny_transformer(), vocoder=vocoder)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(path)
    return pipe


def text_states(batch: int, lengths: list[int], seq: int = 8, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma-like hidden states (batch, seq, CAPTION * TEXT_LAYERS), left-padded, and their
    mask (batch, seq): what diffusers' pipeline takes as prompt_embeds."""
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(batch, seq, CAPTION * TEXT_LAYERS, generator=g)
    mask = torch.zeros(batch, seq, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, seq - n:] = 1
    return states * mask[..., None], mask


def add_tiny_upsampler(path: Path, seed: int = 4) -> Any:
    """A tiny random `LTX2LatentUpsamplerModel` (x2, the released config's rational
    resampler) saved as the folder's latent_upsampler/; -> the reference model."""
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    torch.manual_seed(seed)
    model = randomize(LTX2LatentUpsamplerModel(in_channels=TRANSFORMER["in_channels"],
                                               mid_channels=32,
                                               num_blocks_per_stage=1).eval(), 0.1)
    model.save_pretrained(Path(path) / "latent_upsampler")
    return model
