"""How long a text prompt may be, in characters, before anything tokenizes it.

Tokenizing costs CPU in proportion to the text (a 12 MB prompt took about a minute in the
token counter's child before its 400), so a long text is first judged by its length:

    characters              what happens (prep_pool.TokenCounter.check, every route's one path)
    <= LONG_TEXT_CHARS      tokenized where it is prepared (cheap), or refused there
    > max_model_len * C     400 prompt_too_long at once: it cannot fit
    in between              counted in the token counter's child first

C, the characters one token may cover, is the tokenizer's longest vocabulary entry times 4
(a byte-level entry holds one character per byte, and Unicode composition, NFC, turns at
most 4 code points into one), capped at MAX_CHARS_PER_TOKEN: text averages 2 to 5
characters a token, and only a prompt made of long runs of one character could fit above the
cap. A model whose entry stages report no maximum length (a diffusion model's prompt) takes
at most LONG_TEXT_CHARS.
"""

from __future__ import annotations

from typing import Any

from omnistage.entrypoints.openai.errors import bad_request

MAX_CHARS_PER_TOKEN = 16
NORMALIZATION_SHRINK = 4      # the longest canonical decomposition: composition's most


def chars_per_token(tokenizer: Any) -> int:
    """C above for a Hugging Face tokenizer (its vocabulary read once: call it once)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return MAX_CHARS_PER_TOKEN
    longest = max((len(entry) for entry in get_vocab()), default=MAX_CHARS_PER_TOKEN)
    return max(1, min(MAX_CHARS_PER_TOKEN, NORMALIZATION_SHRINK * longest))


def max_prompt_chars(max_tokens: int | None, per_token: int, floor: int) -> int:
    """The longest text that may still fit `max_tokens` (never below `floor`, the length
    under which tokenizing decides)."""
    return floor if max_tokens is None else max(floor, max_tokens * per_token)


def check_prompt_chars(num_chars: int, most: int, max_tokens: int | None,
                       param: str) -> None:
    """400 naming `param` when a text of `num_chars` characters is over `most`."""
    if num_chars <= most:
        return
    limit = (f"the model's maximum length is {max_tokens} tokens, which hold at most {most} "
             "characters" if max_tokens is not None else
             f"this model takes at most {most} characters")
    raise bad_request(f"{param}: the prompt has {num_chars} characters, but {limit}", param,
                      "prompt_too_long")
