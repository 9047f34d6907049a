"""HunyuanVideo-1.5's prompt encoding (diffusers' `HunyuanVideo15Pipeline.encode_prompt`, the
same in its image-to-video pipeline): two encoders, both returned with their masks.

    prompt -> chat template [system: SYSTEM_MESSAGE, user: prompt] + assistant header
           -> Qwen2.5-VL text model (padded to TEMPLATE_CROP + MLLM_MAX_LENGTH tokens)
           -> hidden_states[-3] (the output of the third-to-last layer, no final norm)
           -> the first TEMPLATE_CROP positions dropped      -> (B, 1000, D), mask (B, 1000)
    prompt -> the texts in "..." or “...” -> 'Text "a". Text "b". '
           -> byT5 (T5 encoder, padded to GLYPH_MAX_LENGTH bytes) -> (B, 256, D2), mask (B, 256)
              (a prompt without quoted text: zeros and a zero mask)

The crop is positional: TEMPLATE_CROP is the token count of the system part of the real
tokenizer's template, and diffusers drops that many positions whatever the tokenizer.

The transformer zeroes every row the masks mark as padding before using it, so the values of
the padded rows do not reach the video. `trim_padding` uses that: the Qwen model runs only up
to the batch's longest prompt (a fraction of the 1108 positions) and the padded rows come back
as zeros; without it every row is HF's own (the masked-out rows included).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from omnistage.models.text_encoders.qwen import QwenTextEncoder
from omnistage.models.text_encoders.t5 import T5Encoder

SYSTEM_MESSAGE = (
    "You are a helpful assistant. Describe the video by detailing the following aspects:"
    "         1. The main content and theme of the video."
    "         2. The color, shape, size, texture, quantity, text, and spatial relationships of "
    "the objects."
    "         3. Actions, events, behaviors temporal relationships, physical movement changes of "
    "the objects."
    "         4. background environment, light, style and atmosphere."
    "         5. camera angles, movements, and transitions used in the video.")
TEMPLATE_CROP = 108          # diffusers' prompt_template_encode_start_idx
MLLM_MAX_LENGTH = 1000       # tokenizer_max_length: positions kept after the crop
MLLM_LAYER = -3              # hidden_states[-(num_hidden_layers_to_skip=2 + 1)]
GLYPH_MAX_LENGTH = 256       # tokenizer_2_max_length
_GLYPH_PATTERN = re.compile(r"\"(.*?)\"|“(.*?)”")


class HunyuanVideo15PromptEmbeds(NamedTuple):
    """What `encode_prompt` returns, in its order (masks 1 = token, in the embeddings' dtype)."""
    prompt_embeds: Tensor           # (B, MLLM_MAX_LENGTH, D)     Qwen2.5-VL hidden states
    prompt_embeds_mask: Tensor      # (B, MLLM_MAX_LENGTH)
    prompt_embeds_2: Tensor         # (B, GLYPH_MAX_LENGTH, D2)   byT5 over the quoted texts
    prompt_embeds_mask_2: Tensor    # (B, GLYPH_MAX_LENGTH)


def glyph_text(prompt: str) -> str | None:
    """The prompt's quoted texts ("..." or “...”), duplicates dropped when there are several,
    as 'Text "a". Text "b". '; None without any."""
    found = [a or b for a, b in _GLYPH_PATTERN.findall(prompt)]
    if len(found) > 1:
        found = list(dict.fromkeys(found))
    return ". ".join(f'Text "{t}"' for t in found) + ". " if found else None


def _mllm_embeds(encoder: QwenTextEncoder, tokenizer: PreTrainedTokenizerBase,
                 prompts: list[str], trim_padding: bool) -> tuple[Tensor, Tensor]:
    """-> hidden states (B, MLLM_MAX_LENGTH, D) in the encoder's dtype, mask (B, ..) int64."""
    chats = [[{"role": "system", "content": SYSTEM_MESSAGE},
              {"role": "user", "content": p or " "}] for p in prompts]
    inputs = tokenizer.apply_chat_template(
        chats, add_generation_prompt=True, tokenize=True, return_dict=True,
        padding="max_length", max_length=MLLM_MAX_LENGTH + TEMPLATE_CROP, truncation=True,
        return_tensors="pt")
    device = encoder.embed_tokens.weight.device
    ids, mask = inputs["input_ids"].to(device), inputs["attention_mask"].to(device)   # (B, S)
    seq_len = ids.shape[1]
    if trim_padding:
        if tokenizer.padding_side != "right":
            raise ValueError(f"trim_padding: needs a right-padding tokenizer, this one pads "
                             f"{tokenizer.padding_side!r}")
        seq_len = int(mask.sum(dim=1).max())
    hidden = encoder(ids[:, :seq_len], mask[:, :seq_len], output_layers=(MLLM_LAYER,))
    hidden = hidden[MLLM_LAYER]                                         # (B, seq_len, D)
    if trim_padding:   # every padded row zero, also those before the longest prompt's end
        hidden = F.pad(hidden, (0, 0, 0, ids.shape[1] - seq_len))
        hidden = torch.where(mask[..., None].bool(), hidden, 0.0)
    return hidden[:, TEMPLATE_CROP:], mask[:, TEMPLATE_CROP:]


def _glyph_embeds(encoder: T5Encoder, tokenizer: PreTrainedTokenizerBase,
                  prompts: list[str]) -> tuple[Tensor, Tensor]:
    """-> byT5 hidden states (B, GLYPH_MAX_LENGTH, D2) in the encoder's dtype, mask int64;
    the prompts with quoted text run as one batch (each row depends on its own text alone)."""
    weight = encoder.shared.weight
    texts = [glyph_text(p) for p in prompts]
    hidden = torch.zeros(len(prompts), GLYPH_MAX_LENGTH, encoder.config.d_model,
                         dtype=weight.dtype, device=weight.device)
    mask = torch.zeros(len(prompts), GLYPH_MAX_LENGTH, dtype=torch.int64, device=weight.device)
    rows = [i for i, t in enumerate(texts) if t is not None]
    if rows:
        tokens = tokenizer([texts[i] for i in rows], padding="max_length",
                           max_length=GLYPH_MAX_LENGTH, truncation=True, add_special_tokens=True,
                           return_tensors="pt")
        row_mask = tokens["attention_mask"].to(weight.device)
        hidden[rows] = encoder(tokens["input_ids"].to(weight.device), row_mask)
        mask[rows] = row_mask
    return hidden, mask


@torch.inference_mode()
def encode_hunyuan_video15_prompts(
        text_encoder: QwenTextEncoder, tokenizer: PreTrainedTokenizerBase,
        glyph_encoder: T5Encoder, glyph_tokenizer: PreTrainedTokenizerBase,
        prompts: list[str], dtype: torch.dtype | None = None, num_videos_per_prompt: int = 1,
        trim_padding: bool = False) -> HunyuanVideo15PromptEmbeds:
    """`HunyuanVideo15Pipeline.encode_prompt(prompts, dtype=dtype, batch_size=len(prompts),
    num_videos_per_prompt=...)`: everything cast to `dtype` (None: the Qwen encoder's; the
    pipeline passes the transformer's), each prompt's rows repeated `num_videos_per_prompt`
    times in place, masks too (diffusers 0.42 tiles its masks instead, p0 p1 p0 p1 against
    embeddings p0 p0 p1 p1: equal only when the prompts are). A negative prompt of None is `[""] * batch` there: pass "" (it encodes as
    " "). `trim_padding`: see the module docstring."""
    if not prompts:
        raise ValueError("prompts: empty")
    if num_videos_per_prompt < 1:
        raise ValueError(f"num_videos_per_prompt={num_videos_per_prompt}: must be at least 1")
    embeds, mask = _mllm_embeds(text_encoder, tokenizer, prompts, trim_padding)
    embeds_2, mask_2 = _glyph_embeds(glyph_encoder, glyph_tokenizer, prompts)
    dtype = dtype or text_encoder.embed_tokens.weight.dtype
    n = num_videos_per_prompt
    return HunyuanVideo15PromptEmbeds(*(t.repeat_interleave(n, dim=0).to(dtype)
                                        for t in (embeds, mask, embeds_2, mask_2)))
