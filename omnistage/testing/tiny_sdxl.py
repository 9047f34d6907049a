"""A tiny random Stable Diffusion XL folder in diffusers' layout, saved by diffusers' own
`StableDiffusionXLPipeline`: a pipeline omnistage has no native port of, which the generic
diffusers adapter (diffusion/diffusers_engine.py) serves. The components follow diffusers'
own SDXL test (`get_dummy_components`), smaller, with the tiny byte-level tokenizer in place of
CLIP's (which would need a download).

    build_tiny_sdxl(folder)   two CLIP text encoders (hidden 32, the second with its
                              projection), a UNet of two blocks, a VAE of two blocks (2x)
    reference(folder, ...)    what diffusers itself makes of one request: the golden image
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

if TYPE_CHECKING:
    import diffusers

MAX_TOKENS = 16         # the tokenizers' model_max_length: SDXL pads every prompt to it


def _text_encoders(path: Path):
    """(tokenizer, CLIP encoder, tokenizer_2, CLIP encoder with projection), tokenizers saved
    under path."""
    import transformers

    tokenizers = [build_tiny_tokenizer(path / name) for name in ("tokenizer", "tokenizer_2")]
    for tokenizer in tokenizers:
        tokenizer.model_max_length = MAX_TOKENS
    config = transformers.CLIPTextConfig(
        vocab_size=len(tokenizers[0]), hidden_size=32, intermediate_size=37,
        num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=MAX_TOKENS,
        projection_dim=32, hidden_act="gelu", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    encoder = transformers.CLIPTextModel(config).eval()
    encoder_2 = transformers.CLIPTextModelWithProjection(config).eval()
    return tokenizers[0], encoder, tokenizers[1], encoder_2


def build_tiny_sdxl(path: Path):
    """Save the folder to `path`; -> diffusers' pipeline (the reference), in float32."""
    import diffusers

    torch.manual_seed(0)
    tokenizer, encoder, tokenizer_2, encoder_2 = _text_encoders(path)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(16, 32), layers_per_block=1, sample_size=16, in_channels=4,
        out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
        use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 1),
        projection_class_embeddings_input_dim=80,    # 6 time ids x 8 + the pooled 32
        cross_attention_dim=64, norm_num_groups=4).eval()
    vae = diffusers.AutoencoderKL(
        block_out_channels=(8, 16), in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4, norm_num_groups=4, sample_size=32).eval()
    scheduler = diffusers.EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        timestep_spacing="leading", steps_offset=1)
    pipe = diffusers.StableDiffusionXLPipeline(
        vae=vae, text_encoder=encoder, tokenizer=tokenizer, text_encoder_2=encoder_2,
        tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler)
    pipe.save_pretrained(path)
    return pipe


def reference(pipe: diffusers.DiffusionPipeline, prompt: str, seed: int, **kw: object
              ) -> torch.Tensor:
    """diffusers' own call for one request, with the generator the adapter gives a request of
    this seed -> uint8 (n, H, W, 3), rounded as diffusers' PIL output is."""
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **kw)
    return torch.from_numpy((out.images * 255).round().astype("uint8"))
