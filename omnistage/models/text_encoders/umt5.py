"""UMT5 encoder: transformers' `UMT5EncoderModel` (Wan's `text_encoder/`, umt5-xxl), and Wan's
prompt encoding on top of it.

UMT5 is T5 v1.1 (gated-gelu feed-forward, RMS layer norms before each sub-layer, unscaled
q k^T, `wo` in float32 for float16, float16 clamping) but for one thing: every block's
self-attention has its own relative position bias table, where T5 reuses block 0's. So the
model is t5.py's stack with `relative_bias_every_layer` on, and this file only names it and
adds what Wan does with it:

    prompts -> prompt_clean -> tokenizer (pad to max_sequence_length, mask)
            -> UMT5 (B, L, D) -> rows past each prompt's token count set to 0 -> (B, L, D)
"""

from __future__ import annotations

import html
import importlib.util
import re

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from omnistage.models.text_encoders.t5 import T5Encoder

WAN_MAX_SEQUENCE_LENGTH = 512   # what WanPipeline encodes prompts to by default


class UMT5Encoder(T5Encoder):
    """`UMT5EncoderModel` with HF's parameter names: per block
    `encoder.block.{i}.layer.0.SelfAttention.relative_attention_bias.weight` (buckets, heads)."""

    model_types = ("umt5",)


def prompt_clean(text: str) -> str:
    """diffusers' Wan `prompt_clean`: ftfy's `fix_text` when ftfy is installed (diffusers
    checks the same way, so both sides of a comparison agree), HTML entities unescaped twice,
    whitespace runs made one space, ends stripped."""
    if importlib.util.find_spec("ftfy") is not None:
        import ftfy
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


@torch.inference_mode()
def encode_wan_prompts(encoder: UMT5Encoder, tokenizer: PreTrainedTokenizerBase,
                       prompts: list[str], max_sequence_length: int = WAN_MAX_SEQUENCE_LENGTH
                       ) -> Tensor:
    """WanPipeline's `_get_t5_prompt_embeds` for a batch of prompts -> (B, max_sequence_length,
    D) in the encoder's dtype (diffusers then casts to the transformer's).

    Every prompt is padded (or truncated) to `max_sequence_length` and encoded with its mask;
    a prompt's first `n` rows are kept, n = its token count, and the rest are zeros, so the
    transformer's cross-attention sees exact zeros past the prompt. Each row depends on its
    prompt alone: prompts of any lengths batch together."""
    if max_sequence_length < 1:
        raise ValueError(f"max_sequence_length={max_sequence_length}: must be at least 1")
    inputs = tokenizer([prompt_clean(p) for p in prompts], padding="max_length",
                       max_length=max_sequence_length, truncation=True, add_special_tokens=True,
                       return_attention_mask=True, return_tensors="pt")
    device = encoder.shared.weight.device
    mask = inputs.attention_mask.to(device)                                  # (B, L)
    hidden = encoder(inputs.input_ids.to(device), mask)                      # (B, L, D)
    num_tokens = mask.gt(0).sum(dim=1)                                       # (B,)
    keep = torch.arange(hidden.shape[1], device=device) < num_tokens[:, None]  # (B, L)
    return torch.where(keep[..., None], hidden, 0.0)                         # (B, L, D)
