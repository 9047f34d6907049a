"""What the AR engine checks of a request before it queues it: ids inside the vocabulary, a
length that leaves room for a new token, hidden layers the model has, stop strings only with a
tokenizer, and the shapes of its embeddings and multimodal positions. Each check raises
ValueError naming the problem; nothing is scheduled for a bad request.

The inputs a request carries besides its token ids own their checks: `PromptInput` (embeddings
in place of the prompt's, a prompt still arriving), `StreamInput` (embeddings streamed from
upstream into its decodes) and `MultimodalInput` (rotary positions, deepstack); a `Sequence`
holds them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
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


@dataclass(slots=True)
class PromptInput:
    """How a prompt arrives when it is not only token ids: embeddings that replace its
    positions' own (a downstream AR stage's prompt: upstream hidden states), whether the ids
    beside them are real (kept for penalties and for downstream stages) or placeholders, and
    whether more may arrive (`open`: prefill what came, sample nothing yet)."""

    embeds: Tensor | None = None     # (P, hidden)
    ids_real: bool = False
    open: bool = False
    # (P,) what the prefix cache hashes in place of the ids, when the embeddings are a function
    # of them (a multimodal prompt: placeholders replaced by a digest of their media, negative
    # so they never equal a token id); None: an embeddings prompt is never cached
    cache_ids: list[int] | None = None

    def add_embeds(self, rows: Tensor, hidden: int, has_ids: bool) -> None:
        """Append (n, hidden) rows to an open prompt; ValueError for a closed prompt, a wrong
        shape, or a prompt that has been streamed as token ids."""
        if not self.open:
            raise ValueError("its prompt is already closed")
        if rows.dim() != 2 or rows.shape[1] != hidden:
            raise ValueError(f"prompt_embeds has shape {tuple(rows.shape)}, "
                             f"expected (num_tokens, {hidden})")
        if has_ids and self.embeds is None:
            raise ValueError("a streamed prompt is either token ids or embeddings")
        self.embeds = rows if self.embeds is None else torch.cat([self.embeds, rows])

    def check_ids(self) -> None:
        """ValueError unless token ids may be appended (open, not streamed as embeddings)."""
        if not self.open:
            raise ValueError("its prompt is already closed")
        if self.embeds is not None:
            raise ValueError("a streamed prompt is either token ids or embeddings")


@dataclass(slots=True)
class StreamInput:
    """Embeddings an upstream stage streams into a request's decodes (a talker's trailing
    text): row t is added to the input embedding of position P + t, the t-th output token fed
    back. While the stream is open a decode waits for its row; once closed, decodes past the
    last row get `pad` added (if set)."""

    embeds: Tensor | None = None     # (rows, hidden)
    open: bool = True
    pad: Tensor | None = None        # (hidden,)

    @property
    def num_rows(self) -> int:
        return 0 if self.embeds is None else self.embeds.shape[0]

    def extend(self, rows: Tensor, hidden: int) -> None:
        """Append (n, hidden) rows; ValueError if their shape is wrong or the stream closed."""
        if rows.dim() != 2 or rows.shape[1] != hidden:
            raise ValueError(f"stream_embeds has shape {tuple(rows.shape)}, "
                             f"expected (num_tokens, {hidden})")
        if not self.open:
            raise ValueError("its input stream is already closed")
        self.embeds = rows if self.embeds is None else torch.cat([self.embeds, rows])


@dataclass(slots=True)
class MultimodalInput:
    """What a multimodal prompt brings besides its embeddings (Qwen3-Omni): its rotary
    positions (3, P) and the offset `rope_delta` of every decode position after it, and the
    deepstack features (positions (K,), features (L, K, hidden)) added inside the first
    layers. A model that writes an image token by token gives its generated tokens their own
    positions: `decode_positions` (3, G), those of generated tokens 0 .. G-1 (GLM-Image: the
    rows and columns of its target grids); the ones after continue at text position +
    rope_delta."""

    positions: Tensor | None = None
    rope_delta: int = 0
    deepstack: tuple[Tensor, Tensor] | None = None
    decode_positions: Tensor | None = None

    def check(self, num_prompt_tokens: int) -> None:
        """ValueError unless the positions cover the prompt (checked once it is complete)."""
        if self.positions is not None:
            check_mrope_positions(self.positions, num_prompt_tokens)
        d = self.decode_positions
        if d is not None and (d.dim() != 2 or d.shape[0] != 3 or d.is_floating_point()):
            raise ValueError(f"decode_positions: expected integer (3, G), got {d.dtype} "
                             f"{tuple(d.shape)}")

    def position_of(self, idx: int, num_prompt_tokens: int) -> tuple[int, int, int]:
        """The (t, h, w) rotary position of the token at sequence position idx >= the
        prompt's length (a decode's)."""
        g = idx - num_prompt_tokens
        if self.decode_positions is not None and 0 <= g < self.decode_positions.shape[1]:
            t, h, w = self.decode_positions[:, g].tolist()
            return t, h, w
        return (idx + self.rope_delta,) * 3
