"""Checkpoints in the two original 4-bit layouts (issue 44): AutoAWQ's GEMM and GPTQ's
(AutoGPTQ / GPTQModel / optimum), as transformers and vLLM read them from config.json:

    "quantization_config": {"quant_method": "awq", "version": "gemm", "bits": 4,
                            "group_size": 128, "zero_point": true}
    "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                            "desc_act": false, "sym": true, "checkpoint_format": "gptq"}

`packed_layout(qc)` reads the config; compressed_tensors.py's `quantized_linears` then swaps
every linear whose checkpoint tensors carry a `qweight` (each part of a fused one) for an
empty PackedInt4Linear (layers/awq_gptq.py, where the tensors are drawn) before the weights
stream in; the rest (lm_head, `modules_to_not_convert`) stay float.
Refused by name: other bit widths, AWQ kernels' other layouts (`version` gemv, gemv_fast,
exllama, ipex, marlin; the llm-awq backend), AWQ without zero points, GPTQ's Marlin /
BitBLAS re-packed formats and a quantized lm_head.
"""

from __future__ import annotations

from omnistage.layers.awq_gptq import PackedLayout

GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}          # checkpoint_format -> zero offset


def _bits_and_group(qc: dict, bits_keys: tuple[str, ...], group_keys: tuple[str, ...]
                    ) -> tuple[int, int]:
    method = qc["quant_method"]
    bits = next((qc[k] for k in bits_keys if k in qc), None)
    if bits != 4:
        raise ValueError(f"quantization_config: {method} with bits {bits} is not read; "
                         "4-bit is")
    group = next((qc[k] for k in group_keys if k in qc), None)
    if not isinstance(group, int) or (group <= 0 and group != -1) or (group > 0 and group % 8
                                                                       and method == "awq"):
        raise ValueError(f"quantization_config: {method} group_size {group!r} is not read "
                         "(a positive group size, or -1 for GPTQ)")
    return bits, group


def awq_layout(qc: dict) -> PackedLayout:
    """An AutoAWQ GEMM config as a PackedLayout; ValueError naming anything else."""
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config: awq version {qc.get('version')!r} is not "
                         "read; the GEMM layout (version gemm) is")
    if str(qc.get("backend", "autoawq")).lower() != "autoawq":
        raise ValueError(f"quantization_config: awq backend {qc.get('backend')!r} is not "
                         "read; AutoAWQ's (autoawq) is")
    if not qc.get("zero_point", True):
        raise ValueError("quantization_config: awq without zero points (zero_point false) "
                         "is not read")
    _, group = _bits_and_group(qc, ("bits", "w_bit"), ("group_size", "q_group_size"))
    if group == -1:
        raise ValueError("quantization_config: awq group_size -1 is not read")
    return PackedLayout("awq", group)


def gptq_layout(qc: dict) -> PackedLayout:
    """A GPTQ config as a PackedLayout; ValueError naming anything else."""
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in GPTQ_FORMATS or qc.get("is_marlin_format"):
        raise ValueError(f"quantization_config: gptq checkpoint_format {fmt!r} is not read; "
                         f"{' and '.join(GPTQ_FORMATS)} are")
    if qc.get("lm_head"):
        raise ValueError("quantization_config: a quantized lm_head (lm_head true) is not read")
    _, group = _bits_and_group(qc, ("bits",), ("group_size",))
    return PackedLayout("gptq", group, zero_offset=GPTQ_FORMATS[fmt],
                        symmetric=bool(qc.get("sym", True)),
                        act_order=bool(qc.get("desc_act", False)))


def packed_layout(qc: dict) -> PackedLayout:
    method = qc.get("quant_method")
    if method == "awq":
        return awq_layout(qc)
    if method == "gptq":
        return gptq_layout(qc)
    raise ValueError(f"quantization_config: quant_method {method!r} is not awq or gptq")

