"""LTX-2's prompt side as a pipeline's `PromptEncoder`: Gemma 3 and the text connectors
(models/text_encoders/ltx2.py `encode_ltx2_prompts`, golden against diffusers' encode_prompt +
connectors), every prompt and the guided requests' negative prompts in one batch, handed to
the transformer per request as

    prompt_embeds (L, caption) video text, audio_prompt_embeds (L, caption) audio text,
    prompt_attention_mask (L,) float 1 / 0; and negative_* of each when guided

L is the tokenizer's padded length (max_sequence_length, 1024 as diffusers)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import Tensor
from transformers import AutoTokenizer

from omnistage.diffusion.params import DiffusionParams
from omnistage.models.ltx2_connectors import LTX2TextConnectors
from omnistage.models.text_encoders import Gemma3TextEncoder, encode_ltx2_prompts
from omnistage.models.text_encoders.ltx2 import LTX2_MAX_SEQUENCE_LENGTH

TEXT_KEYS = ("prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask")


class LTX2PromptEncoder:
    def __init__(self, encoder: Gemma3TextEncoder, connectors: LTX2TextConnectors, tokenizer,
                 device: torch.device, max_sequence_length: int = LTX2_MAX_SEQUENCE_LENGTH
                 ) -> None:
        self.encoder = encoder.to(device).eval()
        self.connectors = connectors.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.max_sequence_length = max_sequence_length
        # which requests run a negative branch: the pipeline's rule (its options) once set
        self.guided: Callable[[DiffusionParams], bool] = lambda p: True

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device,
                        dtype: torch.dtype | None) -> LTX2PromptEncoder:
        """text_encoder/ (Gemma 3), connectors/, tokenizer/ of a diffusers LTX-2 folder."""
        path = Path(path)
        return cls(Gemma3TextEncoder.from_pretrained(path / "text_encoder", device, dtype),
                   LTX2TextConnectors.from_pretrained(path / "connectors", device, dtype),
                   AutoTokenizer.from_pretrained(path / "tokenizer"), device)

    def validate(self, prompt: str, params: DiffusionParams) -> None:
        if not prompt.strip():
            raise ValueError("prompt: must be non-empty")

    def encode(self, prompts: list[str], params: list[DiffusionParams]
               ) -> list[dict[str, Tensor]]:
        """Per request its TEXT_KEYS, and negative_* when guided (an unset negative prompt
        encodes as "", as diffusers)."""
        guided = [self.guided(p) for p in params]
        negatives = [p.negative_prompt or "" for p, g in zip(params, guided) if g]
        pos, neg = encode_ltx2_prompts(self.tokenizer, self.encoder, self.connectors,
                                       list(prompts), negatives or None,
                                       self.max_sequence_length)
        out, k = [], 0
        for i, g in enumerate(guided):
            cond = _row(pos, i, "")
            if g:
                cond.update(_row(neg, k, "negative_"))
                k += 1
            out.append(cond)
        return out


def _row(embeds, i: int, prefix: str) -> dict[str, Tensor]:
    """Prompt i's tensors from an LTX2PromptEmbeds, the mask as float."""
    return {f"{prefix}{k}": v for k, v in zip(
        TEXT_KEYS, (embeds.video[i], embeds.audio[i], embeds.mask[i].float()))}
