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


def build_tiny_text_parts(path: Path) -> dict[str, object]:
    """The prompt side of a tiny HunyuanVideo-1.5 folder, saved under `path` as the pipeline
    saves it: text_encoder/ (a Qwen2_5_VLTextModel, 3 layers, so that hidden_states[-3] is a
    layer's output), tokenizer/ (the tiny byte-level BPE with a chat template, right padding),
    text_encoder_2/ (a byT5-like T5EncoderModel, gated-gelu, 2 layers), tokenizer_2/ (ByT5).
    -> the reference objects by those names (eval, float32)."""
    import transformers

    from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer(path / "tokenizer")
    text_encoder = transformers.Qwen2_5_VLTextModel(transformers.Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [1, 1, 2]},
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)).eval()
    tokenizer_2 = transformers.ByT5Tokenizer()
    text_encoder_2 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=len(tokenizer_2), d_model=24, d_kv=8, d_ff=48, num_layers=2, num_heads=3,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
        relative_attention_max_distance=32, decoder_start_token_id=0)).eval()
    with torch.no_grad():   # HF's 0.02 init leaves the layers near the identity; norms at one
        for name, p in text_encoder.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 1.0 if "embed" in name else 0.2)
        for name, p in [*text_encoder.named_parameters(), *text_encoder_2.named_parameters()]:
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    parts = {"text_encoder": text_encoder, "tokenizer": tokenizer,
             "text_encoder_2": text_encoder_2, "tokenizer_2": tokenizer_2}
    for name, part in parts.items():
        part.save_pretrained(path / name)
    return parts


# The image encoder of the image-to-video pipeline (siglip-so400m-patch14-384 in the real one)
TINY_SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, image_size=28, patch_size=7)


def build_tiny_siglip(path: Path | None = None):  # -> transformers.SiglipVisionModel
    """transformers' SiglipVisionModel with `TINY_SIGLIP`, seed 0, layer norms moved off
    their init, saved to `path` when given (the pipeline's image_encoder/)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**TINY_SIGLIP)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    if path is not None:
        model.save_pretrained(path)
    return model
