"""Write a diffusers model's weights as a GGUF file (diffusers' tensor names), for the GGUF
golden tests and the memory bench: linears whose input width fits the format's blocks are
quantized (Q8_0 by gguf's own quantizer; K-quants, which gguf cannot write, as random blocks
that then ARE the weights both loaders read), everything else F32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import nn

from omnistage.layers.gguf import FORMATS
from tests.helpers.gguf_blocks import random_blocks


def write_gguf(model: nn.Module, file: Path, qtype: int, seed: int = 0,
               scale: float = 1e-4) -> None:
    import gguf
    _, block, _ = FORMATS[qtype]
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    writer = gguf.GGUFWriter(str(file), arch="omnistage-test")
    for i, (name, p) in enumerate(model.state_dict().items()):
        w = p.detach().float().numpy()
        if name in linears and w.shape[1] % block == 0:
            if qtype == gguf.GGMLQuantizationType.Q8_0:
                data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            else:
                data = random_blocks(qtype, w.shape[0], w.shape[1], seed + i, scale)
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(qtype))
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
