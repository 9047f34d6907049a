"""Tiny random HunyuanVideo-1.5 parts built with diffusers' own classes and saved with
`save_pretrained` (the Hub's layout): the transformer alone, and the whole t2v / i2v folders
(diffusers' HunyuanVideo15Pipeline / HunyuanVideo15ImageToVideoPipeline) whose text encoders
are tiny Qwen2.5-VL and T5 models; plus random conditioning in the shapes the encoders give.

    transformer  2 heads x 16 (rope axes 4 + 6 + 6), 2 blocks, 1 refiner block, 4 latent
                 channels (in: 4 + 4 + 1), Qwen width 24, byT5 width 20, SigLIP width 12
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from tests.helpers.diffusion_golden import randomize

LATENT = 4
TEXT_DIM, GLYPH_DIM, IMAGE_DIM = 24, 20, 12
NUM_IMAGE_TOKENS = 5


def tiny_transformer(task_type: str = "t2v", use_meanflow: bool = False):
    import diffusers

    model = diffusers.HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT + 1, out_channels=LATENT, num_attention_heads=2,
        attention_head_dim=16, num_layers=2, num_refiner_layers=1, mlp_ratio=2.0,
        patch_size=1, patch_size_t=1, text_embed_dim=TEXT_DIM, text_embed_2_dim=GLYPH_DIM,
        image_embed_dim=IMAGE_DIM, rope_axes_dim=(4, 6, 6), target_size=64,
        task_type=task_type, use_meanflow=use_meanflow).eval()
    torch.manual_seed(0)
    randomize(model, std=0.2)
    with torch.no_grad():           # norm gains near 1, as trained ones are
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    return model


def save_transformer(path: Path, **kwargs) -> Path:
    tiny_transformer(**kwargs).save_pretrained(path)
    return path


def conditioning(batch: int, lengths: list[int], glyph_lengths: list[int], text_len: int = 9,
                 glyph_len: int = 7, seed: int = 1) -> dict[str, Tensor]:
    """Random Qwen and byT5 states with right-padded masks of the given valid lengths (a
    glyph length 0: no quoted text, the states zero as diffusers' encode_prompt gives)."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randn(batch, text_len, TEXT_DIM, generator=g)
    glyph = torch.randn(batch, glyph_len, GLYPH_DIM, generator=g)
    mask = (torch.arange(text_len)[None] < torch.tensor(lengths)[:, None]).float()
    glyph_mask = (torch.arange(glyph_len)[None] < torch.tensor(glyph_lengths)[:, None]).float()
    glyph = glyph * (torch.tensor(glyph_lengths) > 0).float()[:, None, None]
    return {"encoder_hidden_states": text, "encoder_attention_mask": mask,
            "encoder_hidden_states_2": glyph, "encoder_attention_mask_2": glyph_mask}
