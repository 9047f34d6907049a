"""LoRA adapter files, read into one form: our module path -> (A, B, scaling), so that the
adapter adds `scaling * B (A x)` to that linear's output.

The layouts read, as diffusers' `load_lora_weights` reads them for FLUX.1 / Qwen-Image:

    diffusers / PEFT   transformer.<module>.lora_A.weight (r, in), .lora_B.weight (out, r);
                       also with PEFT's "base_model.model." prefix, or none. scaling =
                       lora_alpha / r from the file's `lora_adapter_metadata` (what
                       `save_lora_weights` writes), else 1 (diffusers: alpha = r)
    kohya (FLUX.1)     lora_unet_double_blocks_<i>_img_attn_qkv.lora_down.weight (r, in),
                       .lora_up.weight (out, r), .alpha (scalar): scaling = alpha / r. A fused
                       qkv (or a single block's linear1 = q | k | v | mlp) is split as diffusers'
                       `_convert_kohya_flux_lora_to_diffusers` does: A shared, B cut by rows

The linears an adapter may update are the unquantized ones and the FP8 / INT8 / GGUF
ones (layers/fp8.py, int8.py, gguf.py: the update runs beside them in the model's dtype). Anything else
(text-encoder weights, LoKr, DoRA, unknown modules, shapes that do not fit the
model) is refused with a ValueError that says what.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from omnistage.layers.fp8 import LINEARS, Fp8Linear
from omnistage.layers.gguf import GGUFLinear
from omnistage.layers.int8 import Int8Linear

WEIGHT_NAME = "pytorch_lora_weights.safetensors"     # diffusers' save_lora_weights file
METADATA_KEY = "lora_adapter_metadata"

# kohya FLUX.1 names -> diffusers module paths (split targets for fused projections)
_KOHYA_DOUBLE = {
    "img_attn_proj": ["attn.to_out.0"],
    "img_attn_qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "img_mlp_0": ["ff.net.0.proj"], "img_mlp_2": ["ff.net.2"], "img_mod_lin": ["norm1.linear"],
    "txt_attn_proj": ["attn.to_add_out"],
    "txt_attn_qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    "txt_mlp_0": ["ff_context.net.0.proj"], "txt_mlp_2": ["ff_context.net.2"],
    "txt_mod_lin": ["norm1_context.linear"],
}
_KOHYA_SINGLE = {
    "linear1": ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"],
    "linear2": ["proj_out"], "modulation_lin": ["norm.linear"],
}
_LINEARS = (*LINEARS, Fp8Linear, Int8Linear, GGUFLinear)      # what an adapter may update
_KOHYA_KEY = re.compile(r"lora_unet_(double|single)_blocks_(\d+)_(\w+?)\.(lora_down\.weight|"
                        r"lora_up\.weight|alpha)$")


@dataclass(frozen=True, slots=True)
class LoraLayer:
    """One linear's low-rank update: out += scaling * B (A x)."""

    a: Tensor               # (r, in)
    b: Tensor               # (out, r)
    scaling: float          # lora_alpha / r


def adapter_file(path: str | Path) -> Path:
    """The safetensors file of an adapter: `path` itself, or the one in folder `path` (diffusers'
    pytorch_lora_weights.safetensors, or the folder's only .safetensors file)."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_dir():
        raise ValueError(f"{path}: no such file or folder")
    if (p / WEIGHT_NAME).is_file():
        return p / WEIGHT_NAME
    files = sorted(p.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{path}: expected {WEIGHT_NAME} or one .safetensors file, found "
                         f"{[f.name for f in files]}")
    return files[0]


def read_adapter(path: str | Path, model: nn.Module) -> dict[str, LoraLayer]:
    """The adapter at `path` for `model` (a diffusers-named transformer): module path ->
    LoraLayer, every shape checked against the module it updates. ValueError says what."""
    file = adapter_file(path)
    tensors, metadata = _read(file)
    if any(k.startswith("lora_unet_") for k in tensors):
        layers = _from_kohya(tensors, model)
    else:
        layers = _from_peft(tensors, _peft_scaling(metadata))
    return _checked(layers, model, file)


def check_adapter(path: str | Path) -> int:
    """What can be known of the adapter at `path` without the model, from the file's header
    alone (no tensor read): a safetensors file of LoRA weights in a layout read here (the
    shapes are checked against the model when a stage loads it). The number of tensors;
    ValueError says what is wrong."""
    file = adapter_file(path)
    keys, metadata = _header(file)
    if any(k.startswith("lora_unet_") for k in keys):
        bad = [k for k in keys if _KOHYA_KEY.fullmatch(k) is None]
        if bad:
            raise ValueError(f"{bad[0]}: not a kohya FLUX.1 LoRA key this loader knows")
    else:
        _peft_pairs(keys)
    return len(keys)


def _read(file: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file; ValueError if it is none or empty."""
    _header(file)
    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


def _header(file: Path) -> tuple[list[str], dict[str, str]]:
    """The tensor names and metadata of a safetensors file; ValueError if it is none, has
    no tensors or its adapter metadata is no JSON."""
    try:
        with safe_open(str(file), framework="pt") as f:
            keys, metadata = list(f.keys()), f.metadata() or {}
    except SafetensorError as exc:
        raise ValueError(f"{file.name}: not a safetensors file ({exc})") from None
    if not keys:
        raise ValueError(f"{file.name}: no tensors")
    try:
        _peft_scaling(metadata)
    except json.JSONDecodeError:
        raise ValueError(f"{file.name}: its {METADATA_KEY} is not JSON") from None
    return keys, metadata


def _peft_scaling(metadata: dict[str, str]) -> float:
    """lora_alpha / r of the transformer's adapter config in the file's metadata, else 1."""
    raw = metadata.get(METADATA_KEY)
    if not raw:
        return 1.0
    config = json.loads(raw)
    r = config.get("transformer.r", config.get("r"))
    alpha = config.get("transformer.lora_alpha", config.get("lora_alpha"))
    patterns = [k for k in ("rank_pattern", "alpha_pattern")
                if config.get(f"transformer.{k}") or config.get(k)]
    if patterns:
        raise ValueError(f"the adapter's metadata has {patterns}: per-module ranks or alphas "
                         "are not supported")
    return 1.0 if r is None or alpha is None else float(alpha) / float(r)


def _from_peft(tensors: dict[str, Tensor], scaling: float) -> dict[str, LoraLayer]:
    return {module: LoraLayer(tensors[ab["lora_A"]], tensors[ab["lora_B"]], scaling)
            for module, ab in _peft_pairs(list(tensors)).items()}


def _peft_pairs(keys: list[str]) -> dict[str, dict[str, str]]:
    """module path -> {"lora_A": key, "lora_B": key} of a diffusers / PEFT file's keys."""
    pairs: dict[str, dict[str, str]] = {}
    for key in keys:
        name = key.removeprefix("base_model.model.")
        if name.startswith(("text_encoder", "unet.")):
            raise ValueError(f"{key}: only the transformer's LoRA weights are supported "
                             "(this adapter has text-encoder or UNet weights)")
        name = name.removeprefix("transformer.")
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B)(?:\.default)?\.weight", name)
        if m is None:
            raise ValueError(f"{key}: not a LoRA weight (lora_A / lora_B; LoKr, DoRA and "
                             "biases are not supported)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = key
    for module, ab in pairs.items():
        if ab.keys() != {"lora_A", "lora_B"}:
            raise ValueError(f"{module}: has {sorted(ab)}, needs lora_A and lora_B")
    return pairs


def _from_kohya(tensors: dict[str, Tensor], model: nn.Module) -> dict[str, LoraLayer]:
    parts: dict[tuple[str, str, str], dict[str, Tensor]] = {}
    for key, t in tensors.items():
        m = _KOHYA_KEY.fullmatch(key)
        table = _KOHYA_DOUBLE if m and m.group(1) == "double" else _KOHYA_SINGLE
        if m is None or m.group(3) not in table:
            raise ValueError(f"{key}: not a kohya FLUX.1 LoRA key this loader knows")
        parts.setdefault(m.groups()[:3], {})[m.group(4)] = t
    modules = dict(model.named_modules())
    layers: dict[str, LoraLayer] = {}
    for (kind, index, name), p in parts.items():
        if "lora_down.weight" not in p or "lora_up.weight" not in p:
            raise ValueError(f"lora_unet_{kind}_blocks_{index}_{name}: needs lora_down and "
                             "lora_up")
        a, b = p["lora_down.weight"], p["lora_up.weight"]
        scaling = float(p["alpha"]) / a.shape[0] if "alpha" in p else 1.0
        block = "transformer_blocks" if kind == "double" else "single_transformer_blocks"
        targets = [f"{block}.{index}.{t}" for t in
                   (_KOHYA_DOUBLE if kind == "double" else _KOHYA_SINGLE)[name]]
        missing = [t for t in targets if t not in modules]
        if missing:
            raise ValueError(f"lora_unet_{kind}_blocks_{index}_{name}: the model has no "
                             f"{missing}")
        sizes = [modules[t].out_features for t in targets]
        if sum(sizes) != b.shape[0]:
            raise ValueError(f"lora_unet_{kind}_blocks_{index}_{name}: lora_up has "
                             f"{b.shape[0]} rows, the modules {targets} {sum(sizes)}")
        for target, piece in zip(targets, b.split(sizes)):     # A shared, B by rows
            layers[target] = LoraLayer(a, piece.contiguous(), scaling)
    return layers


def _checked(layers: dict[str, LoraLayer], model: nn.Module, file: Path
             ) -> dict[str, LoraLayer]:
    modules = dict(model.named_modules())
    for name, layer in layers.items():
        module = modules.get(name)
        if not isinstance(module, _LINEARS):
            raise ValueError(f"{file.name}: {name}: the model has no linear of that name")
        r = layer.a.shape[0]
        if layer.a.dim() != 2 or layer.b.dim() != 2 or layer.b.shape[1] != r or (
                layer.a.shape[1], layer.b.shape[0]) != (module.in_features,
                                                        module.out_features):
            raise ValueError(f"{file.name}: {name}: lora_A {tuple(layer.a.shape)} and lora_B "
                             f"{tuple(layer.b.shape)} do not fit a linear of "
                             f"{module.in_features} -> {module.out_features}")
    return layers


def to_device(layers: dict[str, LoraLayer], device: torch.device, dtype: torch.dtype
              ) -> dict[str, LoraLayer]:
    return {k: LoraLayer(v.a.to(device, dtype), v.b.to(device, dtype), v.scaling)
            for k, v in layers.items()}
