"""Write a float checkpoint folder again in compressed-tensors' FP8 layout, as llm-compressor's
FP8 / FP8-dynamic releases ship it (the layout vLLM reads): each decoder linear's weight in
float8_e4m3fn with `weight_scale` (N, 1) per output channel or (1,) per tensor, activations
dynamic per token, `lm_head` ignored, and the `quantization_config` in config.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _group(strategy: str, targets: list[str]) -> dict:
    return {"targets": targets, "output_activations": None,
            "weights": {"type": "float", "num_bits": 8, "strategy": strategy,
                        "symmetric": True, "dynamic": False, "group_size": None,
                        "observer": "minmax", "block_structure": None, "actorder": None},
            "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                                  "symmetric": True, "dynamic": True, "group_size": None,
                                  "observer": None, "block_structure": None,
                                  "actorder": None}}


def quantize_weight(w: torch.Tensor, strategy: str, scale_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale) with w ~= weight * scale: the scale per row (N, 1) or one (1,)."""
    amax = w.abs().amax(dim=-1, keepdim=True) if strategy == "channel" else w.abs().amax()
    scale = (amax.float().clamp(min=1e-12) / FP8_MAX).to(scale_dtype)
    q = (w.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.reshape(-1, 1) if strategy == "channel" else scale.reshape(1)


def write_fp8_checkpoint(src: Path, dst: Path, *, attention: str = "channel",
                         mlp: str = "channel", scale_dtype: torch.dtype = torch.float32) -> Path:
    """`src` (a float Qwen2/Qwen3 folder) -> `dst` in the FP8 layout; attention and MLP
    projections by their own strategy ("channel" or "tensor")."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        kind = module.rpartition(".")[2]
        if leaf == "weight" and kind in ATTENTION + MLP:
            strategy = attention if kind in ATTENTION else mlp
            out[name], out[f"{module}.weight_scale"] = quantize_weight(t, strategy, scale_dtype)
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "kv_cache_scheme": None, "ignore": ["lm_head"],
        "config_groups": {"group_0": _group(attention, [f"re:.*{k}$" for k in ATTENTION]),
                          "group_1": _group(mlp, [f"re:.*{k}$" for k in MLP])}}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
