"""HunyuanVideo-1.5's prompt encoders as a pipeline's `PromptEncoder`: Qwen2.5-VL (text_encoder/,
tokenizer/) and byT5 (text_encoder_2/, tokenizer_2/) through
models/text_encoders/hunyuan_video15.py (diffusers' `encode_prompt`), the negative prompt
beside the prompt where the guider guides; each request keeps its valid tokens only."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import Tensor
from transformers import AutoTokenizer

from omnistage.diffusion.pipeline import encode_with_negatives
from omnistage.diffusion_params import DiffusionParams
from omnistage.errors import InputError
from omnistage.models.text_encoders.hunyuan_video15 import encode_hunyuan_video15_prompts
from omnistage.models.text_encoders.qwen import QwenTextEncoder
from omnistage.models.text_encoders.t5 import T5Encoder


class PromptEncoder:
    def __init__(self, text_encoder: QwenTextEncoder, tokenizer, glyph_encoder: T5Encoder,
                 glyph_tokenizer, guides: Callable[[DiffusionParams], bool],
                 device: torch.device) -> None:
        self.text_encoder = text_encoder.to(device).eval()
        self.glyph_encoder = glyph_encoder.to(device).eval()
        self.tokenizer, self.glyph_tokenizer = tokenizer, glyph_tokenizer
        self.guides, self.device = guides, device  # the guider encodes a negative

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device, dtype: torch.dtype | None,
                        guides: Callable[[DiffusionParams], bool]) -> PromptEncoder:
        path = Path(path)
        return cls(QwenTextEncoder.from_pretrained(path / "text_encoder", device, dtype),
                   AutoTokenizer.from_pretrained(path / "tokenizer"),
                   T5Encoder.from_pretrained(path / "text_encoder_2", device, dtype),
                   AutoTokenizer.from_pretrained(path / "tokenizer_2"),
                   guides, device)

    def validate(self, prompt: str, params: DiffusionParams) -> None:
        if not prompt.strip():
            raise InputError("prompt: must be non-empty", "prompt")

    def encode(self, prompts: list[str], params: list[DiffusionParams]
               ) -> list[dict[str, Tensor]]:
        """Per request: prompt_embeds (L1, D) and prompt_embeds_2 (L2, D2), the valid tokens
        of each; negative_prompt_embeds(_2) too where the guider guides."""
        def encode_texts(texts: list[str]) -> list[Tensor]:
            out = encode_hunyuan_video15_prompts(self.text_encoder, self.tokenizer,
                                                 self.glyph_encoder, self.glyph_tokenizer,
                                                 texts, trim_padding=True)
            return [(e[m.bool()], e2[m2.bool()]) for e, m, e2, m2 in zip(*out)]

        out = []
        for cond in encode_with_negatives(encode_texts, prompts, params, self.guides):
            text, glyph = cond["prompt_embeds"]
            item = {"prompt_embeds": text, "prompt_embeds_2": glyph}
            if "negative_prompt_embeds" in cond:
                neg, neg_glyph = cond["negative_prompt_embeds"]
                item |= {"negative_prompt_embeds": neg, "negative_prompt_embeds_2": neg_glyph}
            out.append(item)
        return out
