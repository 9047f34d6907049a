"""BAGEL's prompt at the front door: the upstream inferencer's text layout, not Qwen's chat
template. Every text (a plain prompt, or each chat message in order, roles dropped as the
upstream has none) is one segment `<|im_start|> text <|im_end|>`, and the answer starts with
`<|im_start|>` (`understanding.answer_prompt`): the token ids the AR stage (the understanding
expert) reads. The prompt's text goes on too: the diffusion stage draws from it (a chat: the
last user message's text).

A chat's `think: true` on a text answer puts the upstream's VLM_THINK_SYSTEM_PROMPT segment
first (`think_prefix`: the front door adds it as a first message), as its
`interleave_inference(think=True, understanding_output=True)` does: the answer reasons in
<think> </think>, then answers.

Images in a text answer's messages are refused (ViT tokens in the AR engine are not served).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from omnistage.errors import InputError
from omnistage.models.bagel.generate import VLM_THINK_SYSTEM_PROMPT
from omnistage.models.bagel.understanding import answer_prompt

BOS, EOS = "<|im_start|>", "<|im_end|>"


@dataclass(frozen=True, slots=True)
class BagelInputs:
    """What `parse_with_processor` reads: the text, the ids, and no multimodal tensors."""
    prompt: str
    input_ids: torch.Tensor
    input_features: None = None
    audio_feature_lens: None = None
    pixel_values: None = None
    image_grid_thw: None = None
    pixel_values_videos: None = None
    video_grid_thw: None = None
    video_second_per_grid: None = None


class BagelInputProcessor:
    input_modalities = ("text",)

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        ids = [tokenizer.convert_tokens_to_ids(t) for t in (BOS, EOS)]
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            raise ValueError(f"BAGEL tokenizer: no token {BOS} / {EOS}")
        self.bos, self.eos = ids

    @classmethod
    def from_pretrained(cls, path: str | Path) -> BagelInputProcessor:
        return cls(AutoTokenizer.from_pretrained(str(path)))

    @staticmethod
    def think_prefix(modalities: list[str]) -> list[dict[str, str]] | None:
        """The messages a chat's `think: true` goes after (None: not for these modalities:
        an image planned first is the graph bagel_think's, per server)."""
        if set(modalities) != {"text"}:
            return None
        return [{"role": "system", "content": VLM_THINK_SYSTEM_PROMPT}]

    def segments(self, prompt: str | dict[str, Any]) -> tuple[str, list[str]]:
        """(the text the diffusion stage draws from, the text segments in order)."""
        if isinstance(prompt, str):
            return prompt, [prompt]
        if "messages" not in prompt:
            text = prompt.get("prompt")
            if not isinstance(text, str):
                raise InputError("prompt: BAGEL takes a text prompt or chat messages", "prompt")
            return text, [text]
        texts, last_user = [], ""
        for i, message in enumerate(prompt["messages"]):
            content = message["content"]
            if isinstance(content, list):
                other = sorted({p["type"] for p in content} - {"text"})
                if other:
                    raise InputError(f"messages[{i}].content: BAGEL's text answers take text "
                                     f"only here, not {'/'.join(other)}",
                                     f"messages[{i}].content")
                content = "\n".join(p["text"] for p in content)
            texts.append(content)
            if message["role"] == "user":
                last_user = content
        return last_user, texts

    def parse_request(self, prompt: str | dict[str, Any]) -> BagelInputs:
        text, texts = self.segments(prompt)
        if not any(t.strip() for t in texts):
            raise InputError("prompt is empty", "prompt")
        segs = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        ids = answer_prompt(segs, self.bos, self.eos)
        return BagelInputs(text, torch.tensor(ids, dtype=torch.int64))
