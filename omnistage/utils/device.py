"""Device and dtype choice from the user's words ("auto", "cpu", "cuda", "bfloat16", ...)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from torch import Tensor

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={name!r}: choose auto, cpu or cuda[:N]")
    return device


def resolve_dtype(name: str, model_path: Path | None, device: torch.device
                  ) -> torch.dtype | None:
    """"auto": the checkpoint's dtype on CUDA; float32 on CPU, where half precision is slow.
    None where the folder has no config.json of its own (a pipeline of components, as
    GLM-Image's): the loader reads its component's."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype={name!r}: choose auto, {', '.join(_DTYPES)}")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    if model_path is None or not (model_path / "config.json").is_file():
        return None
    config = json.loads((model_path / "config.json").read_text())
    declared = config.get("dtype") or config.get("torch_dtype") or "float32"
    return _DTYPES.get(str(declared).removeprefix("torch."), torch.float32)


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device ("cuda" alone: the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def gpu_name(x: Tensor) -> str:
    """The name of the GPU holding x ("NVIDIA H100 80GB HBM3"); "" off CUDA. Kernels pick
    the settings measured fastest on a GPU by it."""
    if not x.is_cuda:
        return ""
    return _gpu_name(cuda_index(x.device))
