"""What the text encoders share: the folder's HF config, the checkpoint dtype, activations by
HF name, and strict weight import with explicit renames and explicit skips.

    folder/config.json
    folder/model.safetensors                       one file, or
    folder/model.safetensors.index.json + shards   sharded

Each checkpoint name goes through the encoder's `rename` (e.g. drop "text_model."), and is then
either one of our parameters, or matches one of the encoder's explicitly ignored prefixes or
suffixes (tensors the encoder legitimately does not use: an LM head, a vision tower, a T5
decoder, a saved buffer), or an error. Missing, unexpected and mis-shaped tensors raise
ValueError naming them, as `models/loader.py` does for the autoregressive models.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig

from omnistage.models.loader import (PackedModules, _default_dtype, check_tensor_names,
                                     checkpoint_names, iter_safetensors, load_packed_weights)

_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F64": torch.float64}


def read_hf_config(path: Path) -> PretrainedConfig:
    """The folder's config.json, parsed (and migrated from older layouts) by transformers."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model folder)")
    return AutoConfig.from_pretrained(path)


def checkpoint_dtype(path: Path) -> torch.dtype:
    """The dtype of the first stored floating-point tensor (float32 if there is none)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        first = sorted(set(json.loads(index.read_text())["weight_map"].values()))[0]
    else:
        first = "model.safetensors"
    if not (path / first).is_file():
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    with safe_open(path / first, framework="pt", device="cpu") as f:
        for name in f.keys():
            dtype = _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
            if dtype is not None:
                return dtype
    return torch.float32


def _quick_gelu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_new(x: Tensor) -> Tensor:
    """The tanh approximation written out op by op in the input dtype, as HF's `gelu_new`
    (T5 v1.1) computes it: in bfloat16 this rounds like HF, where the fused F.gelu does not."""
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

# HF `hidden_act` / `dense_act_fn` names -> function.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu, "gelu_new": _gelu_new, "gelu_pytorch_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu, "relu": F.relu, "silu": F.silu,
}


def get_activation(name: str, field: str) -> Callable[[Tensor], Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"config.json {field}={name!r}: not supported "
                         f"(supported: {', '.join(sorted(ACTIVATIONS))})")
    return ACTIVATIONS[name]


def build_on(model_cls: Callable[..., nn.Module], config: object, device: torch.device | str,
             dtype: torch.dtype) -> nn.Module:
    """`model_cls(config)` allocated directly on `device` in `dtype`. Our layers start from
    `torch.empty`, so nothing is randomly initialised only to be overwritten."""
    with _default_dtype(dtype), torch.device(device):
        return model_cls(config)


def load_weights_strict(model: nn.Module, path: Path, rename: Callable[[str], str],
                        ignored_prefixes: tuple[str, ...] = (),
                        ignored_suffixes: tuple[str, ...] = (),
                        packed_modules: PackedModules | None = None) -> None:
    """Copy every tensor of the folder into `model`: checkpoint name -> `rename` -> our name,
    where q/k/v (or gate/up) pieces go to their fused parameter per `packed_modules`. Names
    (after renaming) with an ignored prefix or suffix are skipped; anything else that no
    parameter takes, every parameter no tensor fills and every shape mismatch raise ValueError."""
    packed_modules = packed_modules or {}
    found: set[str] = set()

    def used(weights: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in weights:
            name = rename(name)
            if name.startswith(ignored_prefixes) or name.endswith(ignored_suffixes):
                continue
            found.add(name)
            yield name, tensor

    with torch.no_grad():
        loaded = load_packed_weights(model, used(iter_safetensors(Path(path))), packed_modules)
    expected = checkpoint_names(model, packed_modules)
    check_tensor_names(path, type(model).__name__, expected, found)
    not_loaded = {n for n, _ in model.named_parameters()} - loaded
    assert not not_loaded, f"parameters not loaded although the checkpoint has them: {not_loaded}"


def strip_prefix(name: str, prefixes: tuple[str, ...]) -> str:
    """`name` without the first of `prefixes` it starts with."""
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def attention_mask_4d(attention_mask: Tensor | None, seq_len: int, causal: bool
                      ) -> Tensor | None:
    """(B, S) padding mask (1 = token, 0 = padding) -> boolean mask for SDPA, True where a
    query may attend to a key: (B, 1, S, S) causal and padding, or (B, 1, 1, S) padding only.
    None when nothing is padded (SDPA's `is_causal` then does the causal part). Queries at
    padded positions keep attending to the real keys allowed to them, as in HF."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[1] != seq_len:
        raise ValueError(f"attention_mask: expected (B, {seq_len}) like input_ids, got "
                         f"{tuple(attention_mask.shape)}")
    if bool(attention_mask.all()):
        return None
    keys = attention_mask.bool()[:, None, None, :]                          # (B, 1, 1, S)
    if not causal:
        return keys
    pos = torch.arange(seq_len, device=attention_mask.device)
    return keys & (pos[None, :] <= pos[:, None])                            # (B, 1, S, S)
