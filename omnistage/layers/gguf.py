"""GGUF block-quantized linears (issue 44): the weight stays in the file's blocks in memory (one
uint8 row of blocks per output channel) and is dequantized in torch on every call, then one
matmul in the activations' dtype:

    W (N, K) as blocks (N, K / block * block_bytes) uint8 -> dequantize -> (N, K) -> x @ W^T

The block formats (ggml's, as the community ships DiT checkpoints: city96's FLUX.1, Qwen-Image,
Wan files), one block of `block` weights in `bytes` bytes, d / dmin float16:

    Q8_0   32 in  34: d, q int8[32]                               w = d * q
    Q4_0   32 in  18: d, q 4-bit[32] (low nibbles: 0-15, high: 16-31)  w = d * (q - 8)
    Q4_K  256 in 144: d, dmin, 6-bit scale+min x 8 (12 bytes), q 4-bit[256]
                      w = d * sc[j] * q - dmin * m[j], j the 32-weight sub-block
    Q5_K  256 in 176: Q4_K's header, high bits qh[32] (bit j of qh[l]: sub-block j), q 4-bit
    Q6_K  256 in 210: ql 4-bit[256], qh 2-bit[256], int8 scale per 16 weights, d (last)
                      w = d * sc[i] * (q - 32)

Golden per format against `gguf.quants.dequantize` (tests/unit/layers/test_gguf.py). A fused
dequant-matmul kernel is not written yet: CUDA runs the same dequantize-then-matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ggml type id -> (name, weights per block, bytes per block)
FORMATS: dict[int, tuple[str, int, int]] = {
    8: ("Q8_0", 32, 34), 2: ("Q4_0", 32, 18), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
K_SCALE_BYTES = 12


def _half(blocks: Tensor, start: int) -> Tensor:
    """The float16 at byte `start` of every block, as float32 (B, 1)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(q: Tensor) -> tuple[Tensor, Tensor]:
    return (q & 0x0F).to(torch.int16), (q >> 4).to(torch.int16)


def _q8_0(b: Tensor) -> Tensor:
    return _half(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(b: Tensor) -> Tensor:
    lo, hi = _nibbles(b[:, 2:])
    return _half(b, 0) * (torch.cat([lo, hi], dim=1) - 8).float()


def _k_scales(s: Tensor) -> tuple[Tensor, Tensor]:
    """The 8 sub-blocks' 6-bit scales and mins from the 12 packed bytes (B, 12) -> (B, 8) x 2:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7; 4-7 split over bytes 8-11's nibbles
    and the top 2 bits of bytes 0-3 / 4-7."""
    s = s.to(torch.int16)
    sc_lo, m_lo = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc_hi = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    m_hi = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([sc_lo, sc_hi], 1).float(), torch.cat([m_lo, m_hi], 1).float()


def _k_apply(b: Tensor, q: Tensor) -> Tensor:
    """w = d * sc * q - dmin * m over 8 sub-blocks of 32: q (B, 256) in sub-block order."""
    sc, m = _k_scales(b[:, 4:4 + K_SCALE_BYTES])
    q = q.float().unflatten(1, (8, 32))
    w = _half(b, 0)[:, :, None] * sc[:, :, None] * q - _half(b, 2)[:, :, None] * m[:, :, None]
    return w.flatten(1)


def _q4_k(b: Tensor) -> Tensor:
    lo, hi = _nibbles(b[:, 16:].unflatten(1, (4, 32)))                  # (B, 4, 32) each
    return _k_apply(b, torch.stack([lo, hi], 2).flatten(1))            # 2i: low, 2i+1: high


def _q5_k(b: Tensor) -> Tensor:
    qh = b[:, 16:48].to(torch.int16)                                    # (B, 32)
    lo, hi = _nibbles(b[:, 48:].unflatten(1, (4, 32)))
    q = torch.stack([lo, hi], 2).flatten(1, 2)                          # (B, 8, 32)
    bits = (qh[:, None, :] >> torch.arange(8, device=b.device)[None, :, None]) & 1
    return _k_apply(b, (q | (bits << 4)).flatten(1))


def _q6_k(b: Tensor) -> Tensor:
    ql = b[:, :128].unflatten(1, (2, 2, 32)).to(torch.int16)            # (B, half, 2, 32)
    qh = b[:, 128:192].unflatten(1, (2, 32)).to(torch.int16)           # (B, half, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()       # (B, 16)
    low = torch.cat([ql & 0x0F, ql >> 4], 2)                            # (B, half, 4, 32)
    shifts = torch.arange(0, 8, 2, device=b.device)[None, None, :, None]
    high = (qh[:, :, None, :] >> shifts) & 3                            # (B, half, 4, 32)
    q = ((low | (high << 4)) - 32).float().flatten(1).unflatten(1, (16, 16))
    return (_half(b, 208)[:, :, None] * scales[:, :, None] * q).flatten(1)


DEQUANTIZE = {8: _q8_0, 2: _q4_0, 12: _q4_k, 13: _q5_k, 14: _q6_k}


def dequantize(data: Tensor, qtype: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weights a block-quantized tensor stands for: data (..., row bytes) uint8 ->
    (..., row bytes / bytes * block) in `dtype`."""
    if qtype not in DEQUANTIZE:
        raise ValueError(f"GGUF quantization type {qtype} is not supported (supported: "
                         f"{', '.join(name for name, _, _ in FORMATS.values())})")
    _, block, nbytes = FORMATS[qtype]
    rows = data.shape[:-1]
    w = DEQUANTIZE[qtype](data.reshape(-1, nbytes))
    return w.reshape(*rows, data.shape[-1] // nbytes * block).to(dtype)


class GGUFLinear(nn.Module):
    """y = x W^T (+ b) with W kept as GGUF blocks (`qweight`, uint8 (N, row bytes)) and
    dequantized to x's dtype on every call; the bias is a plain tensor."""

    def __init__(self, qweight: Tensor, qtype: int, in_features: int,
                 bias: Tensor | None) -> None:
        super().__init__()
        name, block, nbytes = FORMATS[qtype]
        if qweight.dtype != torch.uint8 or qweight.shape[-1] * block != in_features * nbytes:
            raise ValueError(f"{name} weight of {tuple(qweight.shape)} bytes does not hold "
                             f"{in_features} inputs per row")
        self.qtype, self.in_features, self.out_features = qtype, in_features, qweight.shape[0]
        self.register_buffer("qweight", qweight)
        self.register_buffer("bias", bias)

    @property
    def weight(self) -> Tensor:
        """The dequantized weight in the bias's dtype (float32 without one): for model code
        that reads a linear's weight (Wan's time embedder takes its dtype); the forward
        never calls it."""
        return dequantize(self.qweight, self.qtype,
                          torch.float32 if self.bias is None else self.bias.dtype)

    def weight_like(self, x: Tensor) -> Tensor:
        return dequantize(self.qweight, self.qtype, x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight_like(x), bias)

    def extra_repr(self) -> str:
        return (f"{FORMATS[self.qtype][0]}, in={self.in_features}, out={self.out_features}, "
                f"bias={self.bias is not None}")
