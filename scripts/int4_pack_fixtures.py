"""The fixture of tests/unit/layers/test_int4.py, written by compressed-tensors itself (the
reference of the W4A16 `pack-quantized` layout vLLM reads; not a dependency of ours): a random
weight quantized by its `quantize` (int4, symmetric, per group of 32 along K), packed by its
`pack_to_int32` and dequantized by its `dequantize`. Run it where compressed-tensors imports
(pip install --target DIR compressed-tensors loguru; PYTHONPATH=DIR):

    python scripts/int4_pack_fixtures.py tests/fixtures/int4_pack/pack_quantized.safetensors
"""

from __future__ import annotations

import sys

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from safetensors.torch import save_file

N, K, GROUP = 48, 96, 32


def main(out: str) -> None:
    torch.manual_seed(0)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=GROUP)
    weight = torch.randn(N, K) * torch.linspace(0.1, 2.0, K)        # groups of unequal range
    amax = weight.reshape(N, K // GROUP, GROUP).abs().amax(-1)       # (N, K / GROUP)
    scale = (amax / 7.5).to(torch.bfloat16)                          # the minmax observer's
    zero_point = torch.zeros_like(scale, dtype=torch.int8)
    q = quantize(weight, scale, zero_point, args, dtype=torch.int8)  # (N, K) in [-8, 7]
    save_file({"weight": weight, "q": q, "weight_packed": pack_to_int32(q, 4),
               "weight_scale": scale, "weight_shape": torch.tensor([N, K]),
               "dequantized": dequantize(q, scale, zero_point, args, dtype=torch.float32)},
              out, metadata={"group_size": str(GROUP)})


if __name__ == "__main__":
    main(sys.argv[1])
