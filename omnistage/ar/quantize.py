"""An AR stage's `quantization` (configs/quantization.py `ar_method`) applied to its model once
it has loaded (issue 44), before the KV cache is sized so the freed weights count:

    fp8   every eligible linear in FP8 W8A8 (layers/fp8.py: e4m3 weights per output channel,
          activations per token, one torch._scaled_mm; CUDA 8.9+)
    int8  every eligible linear in INT8 W8A8 (layers/int8.py: torch._int_mm; CPU and CUDA)
    int4  every eligible linear in 4-bit W4A16 (layers/int4.py Int4Linear: symmetric groups
          of 128 inputs, scale = amax / 7.5 in the weight's dtype, round to nearest; decode
          rows through triton_int4.py's kernel on CUDA, else dequantized per call)

Eligible, as vLLM's FP8 of an LLM takes them: every linear of the model (the decoder's q/k/v,
o, gate/up, down, and those of encoders the model holds: a thinker's audio and vision towers)
with both sides a multiple of 16, but the output heads (`*_head`: lm_head, a talker's
codec_head; the vocabulary heads are embeddings tables anyway) and what the model itself keeps
(`fp8_keep`, where it has one). No size floor as a DiT has (layers/fp8.py MIN_FEATURES): a
decode step reads every weight once, so any weight in 8 bits halves its bytes (in 4 bits, a
quarter of them and a scale per group). Mixture-of-experts weights are tensors, not linears,
and stay as loaded. With tensor parallelism each rank's shard is quantized (int4: a
row-parallel shard's inputs must be whole groups of 128, else refused).

A checkpoint that is already quantized (compressed-tensors FP8, models/compressed_tensors.py)
is refused a second method.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from omnistage.configs.quantization import ComponentQuantization
from omnistage.layers.fp8 import Fp8Linear, quantize_fp8, swap_linears
from omnistage.layers.int4 import Int4Linear
from omnistage.layers.int8 import Int8Linear, quantize_int8

logger = logging.getLogger(__name__)

AR_KEEP: tuple[str, ...] = ("*_head",)
AR_MIN_FEATURES = 16


def quantize_model(model: nn.Module, method: ComponentQuantization | None,
                   device: torch.device, allow_cpu: bool = False) -> list[str]:
    """Swap `model`'s eligible linears (module docstring) for `method`'s; returns their names.
    `allow_cpu`: FP8 on the CPU too (tests; torch's CPU `_scaled_mm` has the same meaning)."""
    if method is None:
        return []
    if any(isinstance(m, (Fp8Linear, Int8Linear, Int4Linear)) for m in model.modules()):
        raise ValueError(f"quantization {method}: the checkpoint's linears are quantized "
                         "already (its quantization_config): run it without quantization")
    keep = tuple(getattr(model, "fp8_keep", ())) + AR_KEEP
    if method.method == "fp8":
        swapped = quantize_fp8(model, AR_MIN_FEATURES, allow_cpu, keep=keep)
    elif method.method == "int8":
        swapped = quantize_int8(model, AR_MIN_FEATURES, keep=keep)
    elif method.method == "int4":
        swapped = quantize_int4_linears(model, AR_MIN_FEATURES, keep)
    else:
        raise ValueError(f"quantization {method}: an AR model takes fp8, int8 or int4")
    if not swapped:
        raise ValueError(f"quantization {method}: {type(model).__name__} has no linear "
                         "to quantize (sides multiples of 16, not an output head)")
    logger.info("quantization %s: %d linears of %s", method, len(swapped),
                type(model).__name__)
    if device.type == "cuda":
        torch.cuda.empty_cache()          # the replaced weights' blocks back to the device
    return swapped


def quantize_int4_linears(model: nn.Module, min_features: int, keep: tuple[str, ...]
                          ) -> list[str]:
    """Swap the linears `quantize_int8` would take for Int4Linear (each rank's shard
    quantized, as fp8 / int8 do); returns the names swapped. The float weights are dropped
    with the layers."""
    return swap_linears(model, Int4Linear.from_linear, keep, min_features)
