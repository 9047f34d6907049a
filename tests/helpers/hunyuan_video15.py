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


def build_tiny_t2v(path: Path, guidance_scale: float = 4.0, **guider):
    """diffusers' HunyuanVideo15Pipeline of the tiny transformer and VAE (8x in space, 4x in
    time), flow-match Euler at shift 5, CFG at `guidance_scale` (`guider`: its other config),
    no text encoders (conditioning comes as embeddings), saved to `path`; -> the pipeline."""
    import diffusers

    from tests.helpers.diffusion_golden import save_reference
    from tests.helpers.hunyuan_video15_parts import build_tiny_vae

    pipe = diffusers.HunyuanVideo15Pipeline(
        text_encoder=None, tokenizer=None, transformer=tiny_transformer(), vae=build_tiny_vae(),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=None,
        tokenizer_2=None,
        guider=diffusers.ClassifierFreeGuidance(guidance_scale=guidance_scale, **guider))
    return save_reference(pipe, path)


class FakePromptEncoder:
    """Stands in for the Qwen2.5-VL + byT5 encoders: each text gets fixed random states (its
    valid tokens only, as our encoder keeps them; a text without a quote no glyph tokens);
    `padded` gives diffusers the same states padded, with masks."""

    device = torch.device("cpu")

    def states(self, text: str) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(sum(map(ord, text)) + len(text))
        n = 2 + len(text) % 7
        glyph = 3 if '"' in text else 0
        return torch.randn(n, TEXT_DIM, generator=g), torch.randn(glyph, GLYPH_DIM, generator=g)

    def validate(self, prompt: str, params) -> None:
        pass

    def encode(self, prompts: list[str], params: list) -> list[dict[str, Tensor]]:
        out = []
        for prompt, p in zip(prompts, params):
            text, glyph = self.states(prompt)
            cond = {"prompt_embeds": text, "prompt_embeds_2": glyph}
            if p.guidance_scale is None or p.guidance_scale != 1.0:
                neg, neg_glyph = self.states(p.negative_prompt or "")
                cond |= {"negative_prompt_embeds": neg, "negative_prompt_embeds_2": neg_glyph}
            out.append(cond)
        return out

    def padded(self, text: str, prefix: str = "") -> dict[str, Tensor]:
        """diffusers' keyword arguments for `text` (prefix "negative_" for the negative one):
        Qwen states padded to 9 tokens, byT5 to 7, with their masks."""
        states, glyph = self.states(text)
        out = {}
        for key, s, length in (("prompt_embeds", states, 9), ("prompt_embeds_2", glyph, 7)):
            full = torch.zeros(1, length, s.shape[-1])
            full[0, :s.shape[0]] = s
            mask = (torch.arange(length) < s.shape[0]).long()[None]
            suffix = "_2" if key.endswith("_2") else ""
            out[prefix + key] = full
            out[f"{prefix}prompt_embeds_mask{suffix}"] = mask
        return out
