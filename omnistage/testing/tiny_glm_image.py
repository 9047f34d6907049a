"""A tiny random GLM-Image folder in diffusers' layout, saved by diffusers' own
`GlmImagePipeline`: what the GLM-Image golden tests serve.

    transformer/   2 layers, 2 heads of 8, 2x2 patches, 4 latent channels, codebook 64
    vae/           AutoencoderKL, 4 levels (8x), 4 latent channels, random latents_mean/std
    text_encoder/  ByT5-style T5 encoder (gated GELU), d_model 16; tokenizer/ ByT5's bytes
    scheduler/     flow-match Euler, dynamic shifting as GLM-Image's (base 0.25, max 0.75)

The AR half (vision_language_encoder/, processor/) is not saved here: the DiT's golden test
feeds the reference pipeline `prior_token_ids` as GlmImagePipeline accepts them.
"""

from __future__ import annotations

from pathlib import Path

import torch

C = 4                           # latent channels
CODEBOOK = 64


def build_tiny_glm_image_dit(path: Path):
    """Save the folder at `path`; returns diffusers' pipeline (float32, CPU) on the same
    weights, the reference of the golden tests."""
    import diffusers
    import transformers

    torch.manual_seed(0)
    transformer = diffusers.GlmImageTransformer2DModel(
        patch_size=2, in_channels=C, out_channels=C, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, text_embed_dim=16, time_embed_dim=16, condition_dim=8,
        prior_vq_quantizer_codebook_size=CODEBOOK)
    with torch.no_grad():           # diffusers zero-inits some: make every path count
        for p in transformer.parameters():
            p.normal_(0.0, 0.2)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=C, block_out_channels=(8, 8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1, norm_num_groups=4, sample_size=32,
        latents_mean=torch.randn(C).tolist(), latents_std=(torch.rand(C) + 0.5).tolist())
    text_encoder = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=384, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=8))
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.25, max_shift=0.75, base_image_seq_len=256,
        time_shift_type="linear")
    pipe = diffusers.GlmImagePipeline(
        tokenizer=transformers.ByT5Tokenizer(), processor=None, text_encoder=text_encoder.eval(),
        vision_language_encoder=None, vae=vae.eval(), transformer=transformer.eval(),
        scheduler=scheduler)
    pipe.save_pretrained(path)
    return pipe
