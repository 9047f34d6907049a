"""HunyuanImage-3.0's text-to-image prompt, as the upstream TokenizerWrapper lays it out
(sequence_template "instruct", no system prompt, bot_task "image"), up to the <timestep> token
(what follows does not reach the image):

    <bos> "User: " prompt "\\n\\n" "Assistant: " "<answer>" <boi> <img_size_B> <img_ratio_i> <timestep>
    unconditional row: the prompt's tokens replaced by as many <cfg>
    image_size "auto": the conditional row up to <img_size_B>; the model's greedy next token is
    its <img_ratio_i> (the upstream encodes "Assistant: <answer><boi><img_size_B>" as one text;
    a tokenizer that splits at its added tokens gives the same ids)

Each text piece is encoded alone (no special tokens added). The image size picks its ratio from
the resolution group of the checkpoint's image_base_size (sides base/2 .. 2 base in steps of
base/16, sorted by height/width).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


def resolution_group(base: int) -> list[tuple[int, int]]:
    """(height, width) of each ratio index."""
    step, lo, hi = base // 16, base // 2, base * 2
    sizes = [(base, base)]
    for grow_h in (True, False):
        h = w = base
        while not ((h >= hi and w <= lo) if grow_h else (h <= lo and w >= hi)):
            h, w = (min(h + step, hi), max(w - step, lo)) if grow_h else \
                   (max(h - step, lo), min(w + step, hi))
            sizes.append((h, w))
    return sorted(sizes, key=lambda s: s[0] / s[1])


@dataclass(frozen=True, slots=True)
class PromptLayout:
    tokens: Tensor          # (2, P + 1) long: conditional, unconditional; ends with <timestep>
    timestep_index: int     # P


def ratio_index(base: int, height: int, width: int) -> int | None:
    """The group's index of exactly this size, or None."""
    group = resolution_group(base)
    return group.index((height, width)) if (height, width) in group else None


def _answer_prefix(encode: Callable[[str], list[int]], special: Callable[[str], int], bos: int,
                   text: list[int], base: int) -> tuple[list[int], list[int]]:
    """(head, tail) around the prompt's tokens, up to <img_size_B>."""
    head = [bos] + encode("User: ")
    tail = (encode("\n\n") + encode("Assistant: ") + encode("<answer>")
            + [special("<boi>"), special(f"<img_size_{base}>")])
    return head, tail


def build_prompt(encode: Callable[[str], list[int]], special: Callable[[str], int], bos: int,
                 prompt: str, base: int, ratio: int) -> PromptLayout:
    """encode: text -> ids without special tokens; special: an added token -> its id; bos: the
    tokenizer's bos_token_id."""
    text = encode(prompt)
    head, tail = _answer_prefix(encode, special, bos, text, base)
    tail = tail + [special(f"<img_ratio_{ratio}>"), special("<timestep>")]
    cond = head + text + tail
    uncond = head + [special("<cfg>")] * len(text) + tail
    return PromptLayout(torch.tensor([cond, uncond]), len(cond) - 1)


def build_ratio_prompt(encode: Callable[[str], list[int]], special: Callable[[str], int],
                       bos: int, prompt: str, base: int) -> Tensor:
    """The upstream's image_size "auto" question (bot_task img_ratio): the prompt up to
    <img_size_B>, whose greedy next token is the model's <img_ratio_i>. (1, S) long."""
    text = encode(prompt)
    head, tail = _answer_prefix(encode, special, bos, text, base)
    return torch.tensor([head + text + tail])


def ratio_of_token(token: int, ratio_0: int, base: int) -> int:
    """The ratio index a generated token names; 16 (1:1) when it is no ratio token, as upstream."""
    index = token - ratio_0
    return index if 0 <= index < len(resolution_group(base)) else 16
