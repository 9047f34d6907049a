"""Multimodal rotary embedding (M-RoPE), as Qwen3-Omni's thinker and talker use it.

Every token has three positions, one per axis: t (time / text order), h and w (rows and
columns of an image or video grid). Text tokens have t = h = w. Each rotary frequency j of
the D/2 frequencies takes its angle from one of the three rows. With `mrope_section` (s_t,
s_h, s_w) the INTERLEAVED layout (Qwen3-Omni, Qwen3-VL) assigns the frequencies round-robin:

    j:    0  1  2  3  4  5  6  7 ...
    row:  t  h  w  t  h  w  t  h ...   h while j % 3 == 1 and j < 3 * s_h,
                                       w while j % 3 == 2 and j < 3 * s_w, t otherwise

and the CONTIGUOUS layout (Qwen2-VL, Qwen2.5-Omni) gives the first s_t frequencies to t, the
next s_h to h, the last s_w to w. (With interleaving the sections may add up to more than D/2:
the tail is simply cut off, as in the reference.)

cos/sin are precomputed per frequency, (max_position, D/2) in float32. A forward pass gathers,
for every token and every frequency, the row of that frequency's axis; positions (T,) mean
t = h = w, which is plain RoPE. The rotation is the neox (rotate-half) one of rotary.py, and,
as there, the step's cos/sin are gathered once and shared by all layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from omnistage.layers.rotary import rotate_half


def mrope_axis_of_frequency(num_freqs: int, mrope_section: tuple[int, int, int],
                            interleaved: bool) -> Tensor:
    """(D/2,) int64: which position row (0 = t, 1 = h, 2 = w) drives each frequency."""
    if len(mrope_section) != 3:
        raise ValueError(f"mrope_section {mrope_section}: expected 3 sections (t, h, w)")
    axis = torch.zeros(num_freqs, dtype=torch.int64)
    if interleaved:
        for dim in (1, 2):
            axis[dim:3 * mrope_section[dim]:3] = dim
    else:
        if sum(mrope_section) != num_freqs:
            raise ValueError(f"mrope_section {mrope_section} adds up to {sum(mrope_section)}, "
                             f"expected head_dim / 2 = {num_freqs}")
        axis[mrope_section[0]:mrope_section[0] + mrope_section[1]] = 1
        axis[mrope_section[0] + mrope_section[1]:] = 2
    return axis


def _inv_freq(head_dim: int, max_position: int, rope_parameters: dict[str, Any]
              ) -> tuple[Tensor, float]:
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        theta = rope_parameters["rope_theta"]
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type in ("dynamic", "longrope"):
        raise NotImplementedError(f"rope_type {rope_type!r} with M-RoPE is not supported")
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {rope_type!r}: unknown (known: default, "
                         f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
    hf_config = PretrainedConfig(head_dim=head_dim, hidden_size=head_dim, num_attention_heads=1,
                                 max_position_embeddings=max_position,
                                 rope_parameters=dict(rope_parameters))
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    return inv_freq, float(scaling)


class MRotaryEmbedding(nn.Module):
    """Rotates q (T, H, D) and k (T, Hkv, D) by positions (3, T) (rows t, h, w) or (T,)."""

    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict[str, Any],
                 mrope_section: tuple[int, int, int], interleaved: bool = True) -> None:
        """A `partial_rotary_factor` in rope_parameters (GLM-Image: 0.5) rotates the first
        head_dim * factor features of each head only, the rest passing through."""
        super().__init__()
        rotary_dim = int(head_dim * rope_parameters.get("partial_rotary_factor", 1.0))
        inv_freq, scaling = _inv_freq(rotary_dim, max_position, rope_parameters)
        if inv_freq.numel() * 2 != rotary_dim:
            raise NotImplementedError(f"rotary dim {inv_freq.numel() * 2} != {rotary_dim}")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.mrope_section = tuple(mrope_section)
        self.interleaved = interleaved
        freqs = torch.arange(max_position).float()[:, None] * inv_freq.float()[None, :]
        self.register_buffer("cos_cache", freqs.cos() * scaling, persistent=False)  # (P, R/2)
        self.register_buffer("sin_cache", freqs.sin() * scaling, persistent=False)
        axis = mrope_axis_of_frequency(rotary_dim // 2, self.mrope_section, interleaved)
        self.register_buffer("axis", axis, persistent=False)                      # (D/2,)
        self.register_buffer("freq_idx", torch.arange(rotary_dim // 2), persistent=False)
        self._rows: tuple[Tensor, torch.dtype, Tensor, Tensor] | None = None

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """float32 cos/sin (T, D) for positions (T,) or (3, T)."""
        if positions.dim() == 1:
            cos, sin = self.cos_cache[positions], self.sin_cache[positions]       # (T, D/2)
        else:
            assert positions.dim() == 2 and positions.shape[0] == 3, \
                f"M-RoPE positions must be (T,) or (3, T), got {tuple(positions.shape)}"
            pos = positions[self.axis].t()                    # (T, D/2): position of freq j
            cos = self.cos_cache[pos, self.freq_idx]
            sin = self.sin_cache[pos, self.freq_idx]
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        # Every layer shares this module and the step's `positions`: gather the rows once.
        if self._rows is None or self._rows[0] is not positions or self._rows[1] != q.dtype:
            cos, sin = self.cos_sin(positions)
            self._rows = (positions, q.dtype, cos.unsqueeze(-2).to(q.dtype),      # (T, 1, D)
                          sin.unsqueeze(-2).to(q.dtype))
        cos, sin = self._rows[2], self._rows[3]
        if self.rotary_dim < self.head_dim:
            r = self.rotary_dim
            return (torch.cat([self._rotate(q[..., :r], cos, sin), q[..., r:]], dim=-1),
                    torch.cat([self._rotate(k[..., :r], cos, sin), k[..., r:]], dim=-1))
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    @staticmethod
    def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return x * cos + rotate_half(x) * sin

    def fused_tables(self, positions: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        """What the fused kernels rotate with: (cos, sin) tables (P, D/2) and each frequency's
        position row (positions (3, T) or (T,)); None with partial rotary (the kernels rotate
        whole heads)."""
        if self.rotary_dim < self.head_dim:
            return None
        return self.cos_cache, self.sin_cache, self.axis

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
                f"max_position={self.cos_cache.shape[0]}, "
                f"mrope_section={self.mrope_section}, interleaved={self.interleaved}")
