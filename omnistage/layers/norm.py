"""RMSNorm with Hugging Face numerics: normalise in float32, cast back, then scale.
`F.rms_norm` does the normalisation in one fused kernel where torch has one; on CUDA one Triton
kernel does all of it (fused.py), and `add_forward` folds the residual add in front into it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers import fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:   # x: (..., hidden)
        ops = fused.ops_for(x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """s = x + residual (in x's dtype, as a plain add); returns (norm(s), s). x: (T, hidden)."""
        ops = fused.ops_for(x)
        if ops is not None:
            return ops.add_rms_norm(x, residual, self.weight, self.eps)
        total = x + residual
        return self.forward(total), total

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
