"""Strict weight import for diffusers model folders (e.g. a pipeline's `transformer/`).

    folder/config.json
    folder/diffusion_pytorch_model.safetensors                      one file, or
    folder/diffusion_pytorch_model.safetensors.index.json + shards  sharded

Names map one-to-one onto our parameters (no fused projections). As in `loader.py`, a
missing, unexpected or mis-shaped tensor fails with its name.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterator, TypeVar

import torch
from safetensors import safe_open
from torch import Tensor, nn

from omnistage.models.loader import (_default_dtype, check_tensor_names, checkpoint_names,
                                     load_packed_weights, read_tensors, tensor_nbytes)

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F64": torch.float64}
ConfigT = TypeVar("ConfigT")


def read_config(path: Path) -> dict[str, Any]:
    """config.json without diffusers' private keys (`_class_name`, `_diffusers_version`, ...)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{path}: no config.json (not a diffusers model folder)")
    return {k: v for k, v in json.loads(config.read_text()).items() if not k.startswith("_")}


def config_from_dict(cls: type[ConfigT], raw: dict[str, Any], what: str) -> ConfigT:
    """The config dataclass `cls` from config.json's keys (`read_config`): a key it does not
    know raises ValueError naming it (`what`: the model, for the message); JSON lists become
    tuples, as the frozen dataclasses hold them."""
    unknown = sorted(set(raw) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"{what} config: unknown keys {unknown}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


def safetensors_files(path: Path) -> list[Path]:
    path = Path(path)
    if (path / INDEX_NAME).is_file():
        weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    raise FileNotFoundError(f"{path}: no {WEIGHTS_NAME} or {INDEX_NAME}")


def iter_safetensors(path: Path) -> Iterator[tuple[str, Tensor]]:
    """(name, CPU tensor) for every tensor of the folder, one at a time, the bytes read
    reported as they come (loader.read_tensors)."""
    sizes = {file: tensor_nbytes(file) for file in safetensors_files(path)}
    yield from read_tensors({file: sorted(nbytes) for file, nbytes in sizes.items()}, sizes,
                            f"Loading {Path(path).parent.name}/{Path(path).name}")


def checkpoint_dtype(path: Path) -> torch.dtype:
    """The dtype of the folder's first stored floating-point tensor (float32 if none)."""
    with safe_open(safetensors_files(path)[0], framework="pt", device="cpu") as f:
        for name in f.keys():
            dtype = _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
            if dtype is not None:
                return dtype
    return torch.float32


def load_weights_strict(model: nn.Module, path: Path) -> None:
    """Copy every tensor of `path` into the parameter of the same name; raise ValueError
    naming missing, unexpected or mis-shaped tensors. A model's `ignored_tensors` (module
    names, as diffusers' `_keys_to_ignore_on_load_unexpected`) are skipped: weights that
    older saves hold and no layer uses."""
    seen: list[str] = []
    ignored = set(getattr(model, "ignored_tensors", ()))

    def recorded() -> Iterator[tuple[str, Tensor]]:
        for name, tensor in iter_safetensors(path):
            if ignored.intersection(name.split(".")):
                continue
            seen.append(name)
            yield name, tensor

    with torch.no_grad():
        loaded = load_packed_weights(model, recorded(), {})
    expected = checkpoint_names(model, {})
    check_tensor_names(path, type(model).__name__, expected, set(seen))
    assert loaded == expected, f"parameters not loaded: {expected - loaded}"


def keep_in_fp32(model: nn.Module, names: tuple[str, ...] | None = None) -> None:
    """diffusers' `_keep_in_fp32_modules`: parameters under a module named in `names` (None:
    the model's `keep_in_fp32`), or so named, stay float32 in any dtype, as diffusers loads
    them (small tensors whose rounding would show: time embeddings, modulation tables, norms).
    The benchmarks apply it to diffusers' own models built in bf16 too."""
    names = set(getattr(model, "keep_in_fp32", ()) if names is None else names)
    for name, p in model.named_parameters():
        if names.intersection(name.split(".")):
            p.data = p.data.float()


def build_from_folder(model_cls: type[nn.Module], config: object, path: Path,
                      device: torch.device | str = "cpu",
                      dtype: torch.dtype | None = None) -> nn.Module:
    """`model_cls(config)` in `dtype` (None: the checkpoint's; `keep_in_fp32` parameters
    float32) on `device`, with every tensor from the folder and no random initialisation on
    the way (built on the meta device)."""
    model = build_empty(model_cls, config, path, device, dtype)
    load_weights_strict(model, path)
    return model.eval().requires_grad_(False)


def build_empty(model_cls: type[nn.Module], config: object, path: Path,
                device: torch.device | str = "cpu",
                dtype: torch.dtype | None = None) -> nn.Module:
    """`model_cls(config)` built on the meta device in `dtype` (None: the checkpoint's in
    `path`; `keep_in_fp32` parameters float32), then given uninitialised storage on `device`:
    every tensor still to be loaded."""
    with _default_dtype(dtype or checkpoint_dtype(path)), torch.device("meta"):
        model = model_cls(config)
    keep_in_fp32(model)
    # to_empty replaces meta parameters by new ones: carry the tensor-parallel layers' loaders
    loaders = {name: p.weight_loader for name, p in model.named_parameters()
               if hasattr(p, "weight_loader")}
    model = model.to_empty(device=device)
    for name, p in model.named_parameters():
        if name in loaders:
            p.weight_loader = loaders[name]
    return model
