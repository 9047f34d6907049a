"""Checkpoints that ship FP8 weights (issue 44), in the layout vLLM reads for
`quantization_config.quant_method == "compressed-tensors"` (llm-compressor's FP8 and
FP8-dynamic releases, e.g. RedHatAI's Qwen3 ones):

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {
          "targets": ["Linear"],
          "weights": {"type": "float", "num_bits": 8, "strategy": "channel" | "tensor", ...},
          "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                                "dynamic": true}}},
      "ignore": ["lm_head", ...]}

`fp8_linears(model, hf_config, names, packed_modules)` runs after the model is built and before
its weights stream in: every linear whose checkpoint tensors carry a `weight_scale` becomes an
Fp8CheckpointLinear (layers/fp8_checkpoint.py) that the loader fills with the file's float8
weight and scales; the rest (the `ignore` list: lm_head, towers) stay as they are. Which
linears are quantized is read off the file's tensor names, so a regex `ignore` needs no
interpreting. Refused with a message naming what: static activation scales (`input_scale`),
weight-only FP8 (W8A16), int8 / 4-bit groups, and the block-wise FP8 of Qwen's own `-FP8`
releases (`quant_method: fp8`, `weight_block_size`), which is not read yet.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from omnistage.layers.fp8 import LINEARS, check_fp8_device
from omnistage.layers.fp8_checkpoint import Fp8CheckpointLinear


def quantization_config(hf_config: object) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


def check_fp8_scheme(qc: dict) -> None:
    """ValueError unless `qc` is compressed-tensors FP8 weights with dynamic per-token FP8
    activations."""
    method = qc.get("quant_method")
    if method == "fp8":
        raise ValueError("quantization_config: block-wise FP8 (quant_method fp8, "
                         f"weight_block_size {qc.get('weight_block_size')}) is not read yet; "
                         "a compressed-tensors FP8 checkpoint is")
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config: quant_method {method!r} is not read "
                         "(compressed-tensors FP8 is)")
    for name, group in qc.get("config_groups", {}).items():
        w, a = group.get("weights") or {}, group.get("input_activations")
        where = f"quantization_config.config_groups.{name}"
        if (w.get("type"), w.get("num_bits")) != ("float", 8) or \
                w.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"{where}.weights: FP8 per channel or per tensor is read, not "
                             f"{w.get('type')} {w.get('num_bits')}-bit by "
                             f"{w.get('strategy')}")
        if a is None or (a.get("type"), a.get("num_bits")) != ("float", 8) \
                or not a.get("dynamic"):
            raise ValueError(f"{where}.input_activations: dynamic FP8 activations (per "
                             f"token) are supported, not {a}")


def fp8_linears(model: nn.Module, hf_config: object, names: set[str],
                packed_modules: Mapping[str, tuple[str, int | str]]) -> list[str]:
    """Swap the linears that `names` (the checkpoint's tensor names) quantize for empty
    Fp8CheckpointLinear; returns their module names ([] for a float checkpoint)."""
    qc = quantization_config(hf_config)
    if qc is None:
        return []
    check_fp8_scheme(qc)
    check_fp8_device(next(model.parameters()).device, allow_cpu=True)   # CUDA 8.9+ or CPU
    if any(n.endswith(".input_scale") for n in names):
        raise ValueError("quantization_config: static activation scales (input_scale) are "
                         "not read; dynamic per-token activations are")
    sources: dict[str, list[str]] = {}
    for src, (dst, _) in packed_modules.items():
        sources.setdefault(dst, []).append(src)
    swapped = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, LINEARS):
            continue
        parent, _, child = name.rpartition(".")
        parts = [f"{parent}.{s}" if parent else s for s in sources.get(child, [child])]
        scaled = [f"{p}.weight_scale" in names for p in parts]
        if not any(scaled):
            continue
        if not all(scaled):
            raise ValueError(f"{name}: the checkpoint quantizes only some of "
                             f"{', '.join(parts)}; one fused linear needs all or none")
        setattr(model.get_submodule(parent), child, Fp8CheckpointLinear.from_linear(module))
        swapped.append(name)
    return swapped
