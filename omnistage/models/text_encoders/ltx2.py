"""LTX-2's prompt encoding: what diffusers' `LTX2Pipeline.encode_prompt` and its connectors
call hand the transformer, for a batch of prompts.

    prompts -> strip -> Gemma tokenizer (left padding, pad = eos if unset, to
               max_sequence_length, truncated) -> Gemma 3 (B, L, D, layers + 1)
            -> LTX2TextConnectors -> video (B, L, Dv), audio (B, L, Da), mask (B, L)

Every row depends on its own prompt alone (Gemma masks the padding, the connectors normalise
and attend per row), so prompts and negative prompts encode in one batch; diffusers runs the
connectors on [negative, positive] concatenated, which gives the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from omnistage.models.ltx2_connectors import LTX2TextConnectors
from omnistage.models.text_encoders.gemma3 import Gemma3TextEncoder

LTX2_MAX_SEQUENCE_LENGTH = 1024   # LTX2Pipeline's default max_sequence_length


@dataclass(frozen=True, slots=True)
class LTX2PromptEmbeds:
    """The transformer's text inputs for N prompts (LTX2VideoTransformer3DModel's
    encoder_hidden_states, audio_encoder_hidden_states, and the mask it takes for both)."""
    video: Tensor   # (N, L, video width) in the connectors' dtype
    audio: Tensor   # (N, L, audio width)
    mask: Tensor    # (N, L) int64, 1 = attend: all ones, as diffusers' connectors return it

    def __len__(self) -> int:
        return self.video.shape[0]

    def select(self, rows: slice | list[int]) -> LTX2PromptEmbeds:
        """Some prompts' rows, in the given order."""
        return LTX2PromptEmbeds(self.video[rows], self.audio[rows], self.mask[rows])


def tokenize_ltx2(tokenizer: PreTrainedTokenizerBase, prompts: list[str],
                  max_sequence_length: int) -> tuple[Tensor, Tensor]:
    """LTX2Pipeline's tokenisation -> input_ids, attention_mask (N, max_sequence_length):
    each prompt stripped, special tokens added (Gemma's <bos>), padded on the left to
    `max_sequence_length` and truncated to it; a tokenizer without a pad token pads with its
    eos (diffusers sets that on the tokenizer; so does this). The padding side is an argument
    of the call, so a tokenizer shared with other threads is not switched to left padding."""
    if max_sequence_length < 1:
        raise ValueError(f"max_sequence_length={max_sequence_length}: must be at least 1")
    if tokenizer.pad_token is None:   # as diffusers does (to the tokenizer itself)
        tokenizer.pad_token = tokenizer.eos_token
    inputs = tokenizer([p.strip() for p in prompts], padding="max_length",
                       max_length=max_sequence_length, truncation=True, padding_side="left",
                       add_special_tokens=True, return_tensors="pt")
    return inputs.input_ids, inputs.attention_mask


@torch.inference_mode()
def encode_ltx2_prompts(tokenizer: PreTrainedTokenizerBase, encoder: Gemma3TextEncoder,
                        connectors: LTX2TextConnectors, prompts: list[str],
                        negative_prompts: list[str] | None = None,
                        max_sequence_length: int = LTX2_MAX_SEQUENCE_LENGTH
                        ) -> tuple[LTX2PromptEmbeds, LTX2PromptEmbeds | None]:
    """prompts, and negative prompts for classifier-free guidance (diffusers' default is "";
    any number of them: a batch where only some requests are guided passes those requests'
    negatives, in order) -> (positive, negative or None), each (rows, L, ...) with L =
    max_sequence_length. One Gemma forward and one connectors forward for all of them;
    Gemma's hidden states are cast to the connectors' dtype (diffusers casts them to the
    text encoder's; the two agree when both load in one dtype)."""
    if not prompts:
        raise ValueError("prompts: empty")
    cfg = connectors.config
    if encoder.config.hidden_size != cfg.caption_channels or \
            encoder.num_layers + 1 != cfg.text_proj_in_factor:
        raise ValueError(f"text encoder gives {encoder.num_layers + 1} hidden states of "
                         f"{encoder.config.hidden_size}; the connectors take "
                         f"{cfg.text_proj_in_factor} of {cfg.caption_channels}")
    texts = list(prompts) + list(negative_prompts or [])
    ids, mask = tokenize_ltx2(tokenizer, texts, max_sequence_length)
    device = encoder.embed_tokens.weight.device
    ids, mask = ids.to(device), mask.to(device)
    hidden = encoder(ids, mask)                                             # (N, L, D, layers+1)
    dtype = next(connectors.parameters()).dtype
    video, audio, out_mask = connectors(hidden.to(dtype), mask, left_padded=True)
    embeds = LTX2PromptEmbeds(video, audio, out_mask)
    n = len(prompts)
    negative = embeds.select(slice(n, None)) if negative_prompts is not None else None
    return embeds.select(slice(0, n)), negative
