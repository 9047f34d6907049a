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


def write_bfl_flux_gguf(model: nn.Module, file: Path) -> None:
    """A diffusers FLUX.1 transformer's weights under BFL's names (city96's files' layout:
    stacked qkv, linear1 = q | k | v | mlp, the final modulation's halves swapped), linears
    whose width fits Q8_0 quantized by gguf, the rest F32."""
    import gguf
    import torch

    from omnistage.models.gguf_layouts import SWAP, flux_table
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(file), arch="omnistage-test")
    for original, target in flux_table({n.replace("transformer_blocks.", "double_blocks.")
                                        .replace("single_double_blocks.", "single_blocks.")
                                        for n in state}):
        if isinstance(target, tuple) and target[0] == SWAP:
            scale, shift = state.pop(target[1]).chunk(2)
            w = torch.cat([shift, scale])
        elif all(t in state for t in target):
            w = torch.cat([state.pop(t) for t in target])
        else:
            continue
        w = w.numpy()
        if w.ndim == 2 and w.shape[1] % 32 == 0:
            writer.add_tensor(original, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(original, np.ascontiguousarray(w))
    assert not state, sorted(state)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def wan_original_name(name: str) -> str:
    """A diffusers Wan tensor's name in the Wan repository (the inverse of gguf_layouts'
    WAN_RENAMES, checked against it)."""
    from omnistage.models.gguf_layouts import WAN_RENAMES
    top = {"scale_shift_table": "head.modulation", "proj_out.weight": "head.head.weight",
           "proj_out.bias": "head.head.bias"}
    out = top.get(name, name)
    if name not in top:
        for old, new in reversed(WAN_RENAMES):
            out = out.replace(new, old)
    back = out
    for old, new in WAN_RENAMES:
        back = back.replace(old, new)
    assert back == name, (name, out, back)
    return out


def write_wan_gguf(model: nn.Module, file: Path) -> None:
    """A diffusers Wan transformer's weights under the Wan repository's names, linears whose
    width fits Q8_0 quantized by gguf, the rest F32."""
    import gguf
    writer = gguf.GGUFWriter(str(file), arch="omnistage-test")
    for name, p in model.state_dict().items():
        w = p.detach().float().numpy()
        if w.ndim == 2 and w.shape[1] % 32 == 0:
            writer.add_tensor(wan_original_name(name),
                              gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(wan_original_name(name), np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
