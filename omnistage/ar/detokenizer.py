"""Incremental detokenization of one request's output, with stop strings.

Tokens arrive a few at a time; text must leave as soon as it is final. Two things hold it back:

    decoded output text:  | emitted (self.text) | withheld | pending bytes |
                                                ^ could still start a stop string
                                                           ^ an incomplete UTF-8 character,
                                                             kept inside the token stream

A fast tokenizer is driven through `tokenizers.decoders.DecodeStream`, primed with the last
prompt ids so that the first output token decodes in context (leading spaces, merges across the
prompt boundary). Slow tokenizers use vLLM's prefix_offset/read_offset algorithm.
"""

from __future__ import annotations

from typing import Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from omnistage.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first output token (vLLM's initial offset).
NUM_CONTEXT_TOKENS = 5


class TokenStream(Protocol):
    def step(self, token_id: int) -> str | None: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.params = params
        self.text = ""              # emitted so far; after a stop string hit, the final text
        self.is_stopped = False
        self._decoded = ""          # all decoded output text, emitted + withheld
        self._stream: TokenStream | None = None
        if params.detokenize:
            self._stream = _make_stream(tokenizer, prompt_token_ids, params.skip_special_tokens)

    def step(self, token_ids: list[int]) -> tuple[str, bool]:
        """Feed new output token ids; return (text delta to emit, whether a stop string was hit)."""
        if self._stream is None or self.is_stopped:
            return "", self.is_stopped
        prev_len = len(self._decoded)
        for token_id in token_ids:
            chunk = self._stream.step(token_id)
            if chunk:
                self._decoded += chunk
        if self._check_stop(prev_len):
            self.is_stopped = True
            return self._emit(len(self._decoded)), True
        return self._emit(len(self._decoded) - self._num_withheld()), False

    def finish(self) -> str:
        """Release the text withheld for a possible stop string at the end of the request."""
        if self._stream is None or self.is_stopped:
            return ""
        return self._emit(len(self._decoded))

    def _emit(self, end: int) -> str:
        start = len(self.text)
        assert end >= start, f"emitted text would shrink: {start} -> {end}"
        delta = self._decoded[start:end]
        self.text += delta
        return delta

    def _check_stop(self, prev_len: int) -> bool:
        """Truncate self._decoded at the earliest stop string completed by the new text."""
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            # The old text held no stop string, so a new one ends after prev_len.
            idx = self._decoded.find(stop, max(0, prev_len - len(stop) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        end = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self._decoded = self._decoded[:end]
        return True

    def _num_withheld(self) -> int:
        """Length of the longest suffix of the decoded text that is a proper prefix of a stop."""
        held = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(self._decoded)), held, -1):
                if self._decoded.endswith(stop[:k]):
                    held = k
                    break
        return held


def _make_stream(tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 skip_special_tokens: bool) -> TokenStream:
    context = prompt_token_ids[-NUM_CONTEXT_TOKENS:]
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return _FastStream(backend, context, skip_special_tokens)
    return _SlowStream(tokenizer, context, skip_special_tokens)


class _FastStream:
    def __init__(self, backend: Tokenizer, context: list[int], skip_special_tokens: bool) -> None:
        self.backend = backend
        self.stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        return self.stream.step(self.backend, token_id)


class _SlowStream:
    """vLLM's `detokenize_incrementally`: re-decode a short window of tokens each step and emit
    what it adds beyond the already-read prefix, unless it ends in an incomplete character."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, context: list[int],
                 skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.special_ids = set(tokenizer.all_special_ids)
        self.tokens: list[str] = tokenizer.convert_ids_to_tokens(
            context, skip_special_tokens=skip_special_tokens)
        self.read_offset = len(self.tokens)      # tokens before this are already emitted
        self.prefix_offset = max(self.read_offset - NUM_CONTEXT_TOKENS, 0)

    def step(self, token_id: int) -> str | None:
        if self.skip_special_tokens and token_id in self.special_ids:
            return None
        self.tokens += self.tokenizer.convert_ids_to_tokens([token_id])
        convert = self.tokenizer.convert_tokens_to_string
        prefix_text = convert(self.tokens[self.prefix_offset:self.read_offset])
        new_text = convert(self.tokens[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # an incomplete character: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return new_text[len(prefix_text):]
