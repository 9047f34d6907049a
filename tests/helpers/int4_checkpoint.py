"""Write a float checkpoint folder again in compressed-tensors' W4A16 `pack-quantized` layout,
as llm-compressor's GPTQ / AWQ W4A16 releases ship it (the layout vLLM reads): each decoder
linear's weight as `weight_packed` (N, K / 8) int32, `weight_scale` (N, K / G) and
`weight_shape`, `lm_head` ignored, activations unquantized, and the `quantization_config` in
config.json. Beside it, the reference: the same folder in float32 with each of those weights
replaced by what the layout stands for, q * scale (computed here from q, not unpacked).

The packing is layers/int4.py's `pack_int4`, which tests/unit/layers/test_int4.py checks word
for word against compressed-tensors' own `pack_to_int32` (its fixture)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from omnistage.layers.int4 import pack_int4

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_groups(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (N, K) int8 in [-8, 7], scale (N, ceil(K / G))): symmetric, the minmax observer's
    amax / 7.5 as compressed-tensors' fixture makes it (scripts/int4_pack_fixtures.py)."""
    n, k = w.shape
    groups = -(-k // group_size)
    padded = F.pad(w.float(), (0, groups * group_size - k)).view(n, groups, group_size)
    scale = (padded.abs().amax(-1) / 7.5).clamp(min=1e-8).to(scale_dtype)
    q = torch.round(padded / scale.float()[..., None]).clamp(-8, 7)
    return q.flatten(1)[:, :k].to(torch.int8), scale


def config_block(group_size: int) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "kv_cache_scheme": None, "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "weights": {"type": "int", "num_bits": 4, "strategy": "group",
                            "group_size": group_size, "symmetric": True, "dynamic": False,
                            "observer": "minmax", "actorder": None,
                            "block_structure": None}}}}


def write_int4_checkpoint(src: Path, dst: Path, reference: Path, *, group_size: int = 32,
                          scale_dtype: torch.dtype = torch.bfloat16) -> tuple[Path, Path]:
    """`src` (a float Qwen2/Qwen3 folder) -> (`dst` in the W4A16 layout, `reference`: float32
    with the dequantized weights)."""
    shutil.copytree(src, dst)
    shutil.copytree(src, reference)
    tensors = load_file(src / "model.safetensors")
    packed, dequantized = {}, {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in LINEARS:
            q, scale = quantize_groups(t, group_size, scale_dtype)
            packed[f"{module}.weight_packed"] = pack_int4(q)
            packed[f"{module}.weight_scale"] = scale
            packed[f"{module}.weight_shape"] = torch.tensor(t.shape)
            w = q.float() * scale.float().repeat_interleave(group_size, 1)[:, :t.shape[1]]
            dequantized[name] = w
        else:
            packed[name] = dequantized[name] = t
    save_file(packed, dst / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = config_block(group_size)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst, reference
