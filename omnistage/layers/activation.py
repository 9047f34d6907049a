"""Gated activations over a fused gate_up projection."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class SiluAndMul(nn.Module):
    """(T, 2*I) laid out as | gate | up | -> silu(gate) * up, (T, I)."""

    def forward(self, x: Tensor) -> Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
