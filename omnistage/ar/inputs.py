"""What the AR engine checks of a request before it queues it: ids inside the vocabulary, a
length that leaves room for a new token, hidden layers the model has, stop strings only with a
tokenizer, and the shapes of its embeddings and multimodal positions. Each check raises
ValueError naming the problem; nothing is scheduled for a bad request."""

from __future__ import annotations

from torch import Tensor

from omnistage.models.config import ModelConfig
from omnistage.sampling_params import SamplingParams


def check_request(prompt_token_ids: list[int] | None, params: SamplingParams,
                  prompt_embeds: Tensor | None, cfg: ModelConfig, max_model_len: int,
                  has_tokenizer: bool) -> None:
    params.validate()
    if prompt_embeds is not None:
        if prompt_embeds.dim() != 2 or prompt_embeds.shape[1] != cfg.hidden_size:
            raise ValueError(f"prompt_embeds has shape {tuple(prompt_embeds.shape)}, "
                             f"expected (num_tokens, {cfg.hidden_size})")
        num = prompt_embeds.shape[0]
    else:
        if prompt_token_ids is None:
            raise ValueError("a request needs prompt_token_ids or prompt_embeds")
        num = len(prompt_token_ids)
        bad = [t for t in prompt_token_ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside the vocabulary "
                             f"[0, {cfg.vocab_size}): {bad[:5]}")
    if num == 0:
        raise ValueError("prompt is empty")
    if num >= max_model_len:
        raise ValueError(f"prompt has {num} tokens, but the model's maximum length is "
                         f"{max_model_len} (room for at least one new token needed)")
    top = max(params.output_hidden_layers, default=0)
    if top > cfg.num_hidden_layers:
        raise ValueError(f"output_hidden_layers asks for layer {top}, the model has "
                         f"{cfg.num_hidden_layers} (0 = embeddings .. "
                         f"{cfg.num_hidden_layers} = final)")
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer, and this model has none")


def check_mrope_positions(positions: Tensor, num_tokens: int) -> None:
    """A prompt's multimodal rotary positions: (3, num_tokens)."""
    if positions.dim() != 2 or positions.shape[0] != 3 or positions.shape[1] != num_tokens:
        raise ValueError(f"mrope_positions has shape {tuple(positions.shape)}, "
                         f"expected (3, {num_tokens})")
