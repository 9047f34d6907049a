"""A tiny random Qwen-Image folder whole (Qwen2.5-VL text encoder and tokenizer, transformer,
VAE, scheduler), saved by diffusers' own QwenImagePipeline: what a test that serves Qwen-Image
from a prompt loads (omnistage/testing/diffusion_ranks.py's folder has no text encoder)."""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.testing.diffusion_ranks import QWEN_IMAGE_SCHEDULER
from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

LATENT_CHANNELS = 4


def build_tiny_qwen_image_pipeline(path: Path) -> Path:
    """Save the folder to `path` (64 pixels: 8x8 latents, 4x4 image tokens); -> `path`."""
    import diffusers
    import transformers

    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer(path / "tok")
    text = {"vocab_size": len(tokenizer), "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 2048, "rope_theta": 10000.0, "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default"}}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
              "out_hidden_size": 16}
    text_encoder = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, vocab_size=len(tokenizer))).eval()
    transformer = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
        num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
        axes_dims_rope=(8, 4, 4)).eval()
    vae = diffusers.AutoencoderKLQwenImage(
        base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
        temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, -0.1],
        latents_std=[1.5, 0.8, 1.2, 2.0]).eval()
    with torch.no_grad():   # diffusers zero-inits some layers: make every path count
        for p in transformer.parameters():
            p.normal_(0.0, 0.1)
        for m in transformer.modules():   # RMS weights near 1: the caption matters
            if type(m).__name__ == "RMSNorm":
                m.weight.normal_(1.0, 0.1)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    diffusers.QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                                tokenizer=tokenizer, transformer=transformer).save_pretrained(path)
    return path
