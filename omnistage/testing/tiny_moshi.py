"""Tiny random Mimi and Moshi checkpoints built with transformers' own classes and saved with
`save_pretrained`, for the golden tests of omnistage/models/moshi.

    path = build_tiny_mimi(tmp_path / "mimi")      # a MimiModel folder; returns (path, model)
    path, ref = build_tiny_moshi(tmp_path / "moshi")

Randomised beyond transformers' init where its init would hide bugs: the codebooks (all zero
vectors at init, so every frame would quantize to code 0) and the layer scales (0.01 at init,
which would shrink the transformers' share of the output below the tolerance).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

# 4 ratios of hop 48 and 2x down/upsampling: 96 samples a frame (1920 in the release)
TINY_MIMI: dict[str, Any] = dict(
    hidden_size=32, num_filters=4, num_residual_layers=1, upsampling_ratios=[4, 3, 2, 2],
    kernel_size=5, last_kernel_size=3, residual_kernel_size=3, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, codebook_size=64,
    codebook_dim=16, vector_quantization_hidden_dimension=16, num_quantizers=4,
    num_semantic_quantizers=1, sliding_window=5, upsample_groups=32, sampling_rate=24000,
    max_position_embeddings=256, layer_scale_initial_scale=0.5)

TINY_MOSHI: dict[str, Any] = dict(
    vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, ffn_dim=64, num_codebooks=3, max_position_embeddings=64,
    depth_decoder_config=dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
                              ffn_dim=32, max_position_embeddings=9))


def _randomise_codec(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_sum"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("cluster_usage"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("embed_sum"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))
            elif name.endswith("cluster_usage"):
                buf.copy_(torch.rand(buf.shape, generator=g) + 0.5)
            if name.endswith("embed_sum") or name.endswith("cluster_usage"):
                for cb in model.modules():
                    if hasattr(cb, "_embed"):
                        cb._embed = None          # transformers caches the vectors


def build_tiny_mimi(path: Path, seed: int = 0) -> tuple[Path, nn.Module]:
    from transformers import MimiConfig, MimiModel
    torch.manual_seed(seed)
    model = MimiModel(MimiConfig(**TINY_MIMI)).eval()
    _randomise_codec(model, seed + 1)
    model.save_pretrained(path)
    return Path(path), model


def build_tiny_moshi(path: Path, seed: int = 0, mimi: dict[str, Any] | None = None,
                     **moshi: Any) -> tuple[Path, nn.Module]:
    """`mimi` / `moshi`: overrides of TINY_MIMI / TINY_MOSHI (the duplex tests: the released
    codec's 1920-sample frames, a longer context)."""
    from transformers import MoshiConfig, MoshiForConditionalGeneration
    torch.manual_seed(seed)
    cfg = MoshiConfig(audio_encoder_config=dict(TINY_MIMI, **(mimi or {}), model_type="mimi"),
                      **{**TINY_MOSHI, **moshi})
    model = MoshiForConditionalGeneration(cfg).eval()
    _randomise_codec(model.audio_encoder, seed + 1)
    model.save_pretrained(path)
    return Path(path), model
