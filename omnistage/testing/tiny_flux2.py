"""Tiny random FLUX.2 folders in diffusers' layout, each saved by diffusers' own pipeline: what
the FLUX.2 golden tests (CPU and CUDA) serve.

    build_tiny_flux2_klein  Flux2KleinPipeline: Qwen3 with 28 layers (the stacked 9, 18, 27
                            exist), not step-distilled (CFG)
    build_tiny_flux2_dev    Flux2Pipeline: Mistral-3 with a 31-layer decoder (10, 20, 30) and a
                            tiny Pixtral tower, the guidance embedding; its tokenizer is a plain
                            one with a chat template over content lists (the real folder's is
                            a Pixtral processor, which needs torchvision)

Both: a 2x VAE (4 latent channels, random batch-norm statistics), one double and one single
block of 2 heads x 16, so 32x32 pixels are 8x8 tokens of 2x2 patches.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

# a chat template over Mistral-style content lists (the real one is Mistral Small 3.1's)
CONTENT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
                    "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{{ '<|im_end|>\\n' }}"
                    "{% endfor %}")


def _transformer_and_vae(guidance_embeds: bool):
    import diffusers

    transformer = diffusers.Flux2Transformer2DModel(
        in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=48, axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds).eval()
    vae = diffusers.AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4,
        sample_size=128).eval()     # decodes whole up to 128 px, as diffusers without tiling
    with torch.no_grad():   # diffusers zero-inits some layers: make every path count
        for model in (transformer, vae):
            for p in model.parameters():
                p.normal_(0.0, 0.1)
        vae.bn.running_mean.normal_(0.0, 0.3)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return transformer, vae


def _scheduler():
    import diffusers

    return diffusers.FlowMatchEulerDiscreteScheduler(   # FLUX.2's scheduler config
        shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential")


def build_tiny_flux2_klein(path: Path):
    """-> diffusers' Flux2KleinPipeline from tiny random components, saved to `path`."""
    import diffusers
    import transformers

    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer(path / "tok")
    text_encoder = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=28,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
        pad_token_id=0)).eval()
    transformer, vae = _transformer_and_vae(guidance_embeds=False)
    pipe = diffusers.Flux2KleinPipeline(scheduler=_scheduler(), vae=vae,
                                        text_encoder=text_encoder, tokenizer=tokenizer,
                                        transformer=transformer, is_distilled=False)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(path)
    return pipe


def build_tiny_flux2_dev(path: Path):
    """-> diffusers' Flux2Pipeline from tiny random components, saved to `path`."""
    import diffusers
    import transformers

    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer(path / "tok")
    tokenizer.chat_template = CONTENT_TEMPLATE
    text_encoder = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=16,
                         intermediate_size=32, num_hidden_layers=31, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
                         rope_theta=1e9, sliding_window=None, pad_token_id=0),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=32,
                           patch_size=8, head_dim=8),
        spatial_merge_size=2, image_token_index=len(tokenizer) - 1)).eval()
    transformer, vae = _transformer_and_vae(guidance_embeds=True)
    pipe = diffusers.Flux2Pipeline(scheduler=_scheduler(), vae=vae, text_encoder=text_encoder,
                                   tokenizer=tokenizer, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(path)
    return pipe

