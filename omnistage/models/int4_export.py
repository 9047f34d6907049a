"""Write a float decoder checkpoint again in compressed-tensors' W4A16 `pack-quantized` layout
(what models/compressed_tensors.py reads, what vLLM reads for llm-compressor's W4A16 releases):
round-to-nearest, symmetric groups along K, no calibration (GPTQ / AWQ choose their scales and
rounding with data; the layout is the same). For benchmarks and tests on checkpoints that have
no published 4-bit release here:

    python -m omnistage.models.int4_export SRC DST [--group-size 128]

The decoder layers' q/k/v/o and gate/up/down projections (`model.layers.*`, mixture-of-experts
weights excluded: they load as stacked tensors) become `weight_packed`, `weight_scale` (bf16)
and `weight_shape`; everything else (embeddings, norms, `lm_head`) is copied as stored.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from omnistage.layers.int4 import quantize_int4
from omnistage.models.loader import iter_safetensors

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantization_config(group_size: int) -> dict:
    """The config.json block of the layout, as llm-compressor writes it for W4A16."""
    weights = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": group_size,
               "symmetric": True, "dynamic": False, "observer": "minmax", "actorder": None,
               "block_structure": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "kv_cache_scheme": None,
            "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None,
                                          "output_activations": None}}}


def is_projection(name: str) -> bool:
    module, _, leaf = name.rpartition(".")
    return (leaf == "weight" and name.startswith("model.layers.") and ".experts." not in name
            and module.rpartition(".")[2] in PROJECTIONS)


def export_w4a16(src: Path, dst: Path, group_size: int = 128) -> Path:
    """`src` (a float Hugging Face folder) -> `dst` with its projections packed; returns dst."""
    src, dst = Path(src), Path(dst)
    if (dst / "config.json").is_file():
        raise FileExistsError(f"{dst}: a checkpoint is there already")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model.safetensors") \
                and not f.name.endswith(".safetensors"):
            shutil.copy2(f, dst / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in iter_safetensors(src):
        if not is_projection(name):
            tensors[name] = t
            continue
        module = name.rpartition(".")[0]
        packed, scale = quantize_int4(t, group_size, torch.bfloat16)
        tensors[f"{module}.weight_packed"] = packed
        tensors[f"{module}.weight_scale"] = scale
        tensors[f"{module}.weight_shape"] = torch.tensor(t.shape)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config(group_size)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args()
    print(export_w4a16(Path(args.src), Path(args.dst), args.group_size))


if __name__ == "__main__":
    main()
