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
weight-only FP8 (W8A16), int8 groups, and the block-wise FP8 of Qwen's own `-FP8`
releases (`quant_method: fp8`, `weight_block_size`), which is not read yet.

The W4A16 `pack-quantized` format (llm-compressor's GPTQ / AWQ releases saved packed, and
AWQ / GPTQ models converted to compressed-tensors: what vLLM reads for them) takes the same
road through `int4_linears`: every linear whose tensors carry a `weight_packed` becomes an
Int4CheckpointLinear (layers/int4_checkpoint.py) filled with the file's words and group
scales:

    "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
        "weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128,
                    "symmetric": true, "dynamic": false, "actorder": null}}}

Refused by name: asymmetric groups (`weight_zero_point`), activation-ordered groups
(`actorder: group`, `weight_g_idx`), quantized activations, other bit widths, groups of
different sizes in one checkpoint. `quantized_linears` picks the road from the format.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from omnistage.layers.awq_gptq import PackedInt4Linear
from omnistage.layers.fp8 import LINEARS, check_fp8_device
from omnistage.layers.fp8_checkpoint import Fp8CheckpointLinear
from omnistage.layers.int4_checkpoint import Int4CheckpointLinear
from omnistage.models.awq_gptq import packed_layout


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


def is_pack_quantized(qc: dict) -> bool:
    """Whether the config says compressed-tensors' packed integer format (at its top or in a
    config group, where newer releases put it)."""
    groups = qc.get("config_groups") or {}
    return qc.get("quant_method") == "compressed-tensors" and (
        qc.get("format") == "pack-quantized"
        or any(g.get("format") == "pack-quantized" for g in groups.values()))


def int4_group_size(qc: dict) -> int:
    """The group size of a W4A16 pack-quantized config; ValueError naming what else it is."""
    sizes = set()
    for name, group in (qc.get("config_groups") or {}).items():
        w, where = group.get("weights") or {}, f"quantization_config.config_groups.{name}"
        if (w.get("type"), w.get("num_bits"), w.get("strategy")) != ("int", 4, "group"):
            raise ValueError(f"{where}.weights: 4-bit integer groups (W4A16) are read in the "
                             f"pack-quantized format, not {w.get('type')} "
                             f"{w.get('num_bits')}-bit by {w.get('strategy')}")
        if not w.get("symmetric", True):
            raise ValueError(f"{where}.weights: asymmetric groups (a zero point) are not "
                             "read; symmetric ones are")
        if w.get("actorder") in ("group", True):
            raise ValueError(f"{where}.weights: activation-ordered groups (actorder "
                             f"{w.get('actorder')!r}, weight_g_idx) are not read")
        if group.get("input_activations") is not None:
            raise ValueError(f"{where}.input_activations: weight-only 4-bit (W4A16) is read, "
                             f"not quantized activations {group['input_activations']}")
        sizes.add(int(w["group_size"]))
    if len(sizes) != 1:
        raise ValueError(f"quantization_config: one group size for every linear is read, got "
                         f"{sorted(sizes) or 'none'}")
    return sizes.pop()


def _swap_linears(model: nn.Module, names: set[str],
                  packed_modules: Mapping[str, tuple[str, int | str]], marker: str,
                  make) -> list[str]:   # make: linear -> its quantized form
    """Swap every linear whose checkpoint tensors (each part of a fused one) carry `marker`."""
    sources: dict[str, list[str]] = {}
    for src, (dst, _) in packed_modules.items():
        sources.setdefault(dst, []).append(src)
    swapped = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, LINEARS):
            continue
        parent, _, child = name.rpartition(".")
        parts = [f"{parent}.{s}" if parent else s for s in sources.get(child, [child])]
        marked = [f"{p}.{marker}" in names for p in parts]
        if not any(marked):
            continue
        if not all(marked):
            raise ValueError(f"{name}: the checkpoint quantizes only some of "
                             f"{', '.join(parts)}; one fused linear needs all or none")
        setattr(model.get_submodule(parent), child, make(module))
        swapped.append(name)
    return swapped


def int4_linears(model: nn.Module, qc: dict, names: set[str],
                 packed_modules: Mapping[str, tuple[str, int | str]]) -> list[str]:
    """Swap the linears that `names` (the checkpoint's tensor names) pack in 4 bits for empty
    Int4CheckpointLinear; returns their module names."""
    group_size = int4_group_size(qc)
    for suffix, what in ((".weight_zero_point", "asymmetric groups (weight_zero_point)"),
                         (".weight_g_idx", "activation-ordered groups (weight_g_idx)")):
        if any(n.endswith(suffix) for n in names):
            raise ValueError(f"quantization_config: {what} are not read")
    return _swap_linears(model, names, packed_modules, "weight_packed",
                         lambda linear: Int4CheckpointLinear.from_linear(linear, group_size))


def quantized_linears(model: nn.Module, hf_config: object, names: set[str],
                      packed_modules: Mapping[str, tuple[str, int | str]]) -> list[str]:
    """The checkpoint's quantized linears swapped in (FP8 or 4-bit, by its format; AutoAWQ and
    GPTQ through models/awq_gptq.py) before its weights stream in; [] for a float
    checkpoint."""
    qc = quantization_config(hf_config)
    if qc is not None and is_pack_quantized(qc):
        return int4_linears(model, qc, names, packed_modules)
    if qc is not None and qc.get("quant_method") in ("awq", "gptq"):   # models/awq_gptq.py
        layout = packed_layout(qc)       # every linear shipping a `qweight` (each fused part)
        return _swap_linears(model, names, packed_modules, "qweight",
                             lambda linear: PackedInt4Linear(linear, layout))
    return fp8_linears(model, hf_config, names, packed_modules)


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
    return _swap_linears(model, names, packed_modules, "weight_scale",
                         Fp8CheckpointLinear.from_linear)
