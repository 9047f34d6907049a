"""Gated activations over a fused gate_up projection."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers import fused


class SiluAndMul(nn.Module):
    """(T, 2*I) laid out as | gate | up | -> silu(gate) * up, (T, I). One Triton kernel on CUDA."""

    def forward(self, x: Tensor) -> Tensor:
        ops = fused.ops_for(x)
        if ops is not None:
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
