"""A DiT transformer from a GGUF file (issue 44): the architecture from the diffusers folder's
config.json, the weights from one `.gguf` file whose tensor names are diffusers' (as
`diffusers.loaders.single_file` leaves a file it need not convert) or BFL's FLUX.1 names
or Wan's original names (city96's files; models/gguf_layouts.py maps them, as diffusers
converts them).

Every linear whose weight the file holds in a block format (layers/gguf.py: Q8_0, Q4_0, Q4_K,
Q5_K, Q6_K) becomes a GGUFLinear that keeps the blocks; every other tensor (F32 / F16 / BF16,
or a quantized non-linear weight, dequantized) loads as a plain parameter. As the safetensors
loader does, a missing, unexpected or mis-shaped tensor fails with its name.

The `gguf` package (pip install gguf, the extra `omnistage[gguf]`) reads the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from omnistage.layers.gguf import FORMATS, GGUFLinear, dequantize
from omnistage.layers.fp8 import LINEARS
from omnistage.models.gguf_layouts import to_diffusers_names
from omnistage.models.diffusers_loader import keep_in_fp32
from omnistage.models.loader import _default_dtype, check_tensor_names

PLAIN = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}   # ggml F32, F16, BF16


def read_gguf(file: Path) -> dict[str, tuple[int, Tensor]]:
    """name -> (ggml type, tensor): plain types in their torch shape, block types as uint8
    (rows..., row bytes). Memory-mapped: the tensors view the file until copied."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ImportError("GGUF weights need the gguf package: pip install gguf") from e
    out = {}
    for t in GGUFReader(str(file)).tensors:
        qtype = int(t.tensor_type)
        if qtype not in PLAIN and qtype not in FORMATS:
            raise ValueError(f"{file}: tensor {t.name} has GGUF type {t.tensor_type.name}; "
                             f"supported: F32, F16, BF16, "
                             f"{', '.join(name for name, _, _ in FORMATS.values())}")
        data = np.asarray(t.data)
        if qtype == 30:
            data = data.view(np.int16)
        tensor = torch.from_numpy(data.copy())
        out[t.name] = (qtype, tensor.view(torch.bfloat16) if qtype == 30 else tensor)
    return out


def swap_quantized_linears(model: nn.Module, tensors: dict[str, tuple[int, Tensor]]) -> set[str]:
    """Replace each linear whose weight is a block type in `tensors` by a GGUFLinear (bias
    from the file); returns the tensor names so taken. Tensor-parallel layers only on one rank
    (their weight is then the whole checkpoint tensor)."""
    taken = set()
    for name, module in list(model.named_modules()):
        qtype, data = tensors.get(f"{name}.weight", (None, None))
        if not isinstance(module, LINEARS) or qtype not in FORMATS:
            continue
        tp = getattr(module, "tp", None)
        if tp is not None and tp.world_size > 1:
            raise ValueError(f"GGUF weights run on one tensor-parallel rank; {name} is split "
                             f"over {tp.world_size}")
        bias = None
        if module.bias is not None:
            bias = as_param(tensors, f"{name}.bias", module.bias).to(module.bias.dtype)
            taken.add(f"{name}.bias")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child,
                GGUFLinear(data, qtype, module.weight.shape[1], bias))
        taken.add(f"{name}.weight")
    return taken


def as_param(tensors: dict[str, tuple[int, Tensor]], name: str, param: Tensor) -> Tensor:
    """The file's tensor `name` in the shape of `param` (dequantized if a block type)."""
    if name not in tensors:
        raise ValueError(f"GGUF file has no tensor {name}")
    qtype, data = tensors[name]
    value = dequantize(data, qtype) if qtype in FORMATS else data
    if value.numel() != param.numel():
        raise ValueError(f"GGUF tensor {name}: expected shape {tuple(param.shape)}, "
                         f"got {tuple(value.shape)}")
    return value.reshape(param.shape)


def build_from_gguf(model_cls: type[nn.Module], config: object, file: Path,
                    device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """`model_cls(config)` with the weights of the GGUF `file`: block-quantized linears stay
    blocks (GGUFLinear, computing in the activations' dtype), the rest in `dtype`
    (`keep_in_fp32` parameters float32)."""
    tensors = read_gguf(Path(file))
    with _default_dtype(dtype), torch.device("meta"):
        model = model_cls(config)
    keep_in_fp32(model)
    # city96's FLUX.1 / Wan files: the original repositories' names (models/gguf_layouts.py)
    tensors = to_diffusers_names(tensors, {n: t.shape[0] for n, t in model.state_dict().items()
                                           if t.dim()})
    taken = swap_quantized_linears(model, tensors)
    expected = {n for n, _ in model.named_parameters()} | taken
    check_tensor_names(Path(file), model_cls.__name__, expected, set(tensors))
    model = model.to_empty(device=device)              # empties the GGUFLinears' buffers too
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(as_param(tensors, name, p))
        for name, m in model.named_modules():
            if isinstance(m, GGUFLinear):
                m.qweight = tensors[f"{name}.weight"][1].to(device)
                if m.bias is not None:
                    m.bias = as_param(tensors, f"{name}.bias", m.bias).to(device, m.bias.dtype)
    return model.eval().requires_grad_(False)
