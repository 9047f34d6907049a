"""Sampling maths shared by the AR sampler (ar/sampler.py) and models that sample inside
their own forward (the Qwen3-Omni code predictor): pure tensor code."""

from __future__ import annotations

import torch
from torch import Tensor

# Below this a temperature is treated as greedy: dividing by it would overflow float32 logits.
GREEDY_EPS = 1e-5


def apply_top_k_top_p(x: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask (-inf) all but each row's top_k logits, then all but the smallest set of tokens whose
    cumulative probability reaches top_p. The top token always survives. x: (S, V)."""
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)        # (S, V)
    pos = torch.arange(x.shape[1], device=x.device)[None, :]
    sorted_x = sorted_x.masked_fill(pos >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs                            # mass of better tokens
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0) & (pos > 0)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)
