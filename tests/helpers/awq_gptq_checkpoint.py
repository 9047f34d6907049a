"""Write a float checkpoint folder again in AutoAWQ's GEMM layout or GPTQ's, packed here from
the documented formulas alone (nothing of omnistage's packing is used), and beside it the
reference: the same folder in float32 with each quantized weight replaced by what the layout
stands for, computed here from the integers before packing:

    AWQ    qweight (K, N / 8): word w of row k holds column 8w + ORDER[i] at bits 4i.. with
           ORDER = 0 2 4 6 1 3 5 7 (AutoAWQ's WQLinear_GEMM); qzeros (K / G, N / 8) likewise;
           scales (K / G, N) fp16; W[n, k] = (q[k, n] - z[k / G, n]) * s[k / G, n]
    GPTQ   qweight (K / 8, N): word w of column n holds row 8w + i at bits 4i..; qzeros
           (K / G, N / 8) sequential, storing z - 1 in the v1 "gptq" format and z in
           "gptq_v2"; scales (K / G, N) fp16; g_idx (K,): the group of each input, groups
           taken in a random column order with desc_act (one order shared by the linears of
           one input: q/k/v, gate/up, as GPTQ's Hessian order is)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "down"}
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> int32 with the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_along_columns(ints: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """(R, C) ints in [0, 15] -> (R, C / 8) int32; nibble i of word w = column 8w + order[i]."""
    r, c = ints.shape
    words = torch.zeros(r, c // 8, dtype=torch.int64)
    for w in range(c // 8):
        for i in range(8):
            words[:, w] |= ints[:, 8 * w + order[i]].long() << (4 * i)
    return to_int32(words)


def pack_along_rows(ints: torch.Tensor) -> torch.Tensor:
    """(R, C) ints in [0, 15] -> (R / 8, C) int32; nibble i of word w = row 8w + i."""
    r, c = ints.shape
    words = torch.zeros(r // 8, c, dtype=torch.int64)
    for w in range(r // 8):
        for i in range(8):
            words[w] |= ints[8 * w + i].long() << (4 * i)
    return to_int32(words)


def quantize(w: torch.Tensor, g_idx: torch.Tensor, num_groups: int, sym: bool,
             min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (N, K) -> (q (N, K) in [0, 15], z (N, groups), s (N, groups) fp16), each group's
    columns those with g_idx == group: min-max asymmetric (z in [min_zero, 15]) or symmetric
    (z = 8, s = 2 amax / 15), as AutoAWQ's and GPTQ's quantizers do."""
    n = w.shape[0]
    s, z = torch.empty(n, num_groups), torch.empty(n, num_groups)
    for g in range(num_groups):
        cols = w[:, g_idx == g].float()
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            s[:, g] = (2 * torch.maximum(lo.abs(), hi) / 15).clamp(min=1e-5)
            z[:, g] = 8
        else:
            s[:, g] = ((hi - lo) / 15).clamp(min=1e-5)
            z[:, g] = torch.round(-lo / s[:, g]).clamp(min_zero, 15)
    s = s.half()
    zk, sk = z[:, g_idx.long()], s.float()[:, g_idx.long()]
    q = torch.round(w.float() / sk + zk).clamp(0, 15)
    return q.to(torch.int64), z.to(torch.int64), s


def config_block(method: str, group_size: int, sym: bool, act_order: bool, fmt: str) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group_size,
                "zero_point": True, "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
            "sym": sym, "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
            "checkpoint_format": fmt}


def g_index(k: int, group: int, act_order: bool, seed: int) -> torch.Tensor:
    """The group of each of k inputs: k // G, or the groups of a random column order."""
    if not act_order:
        return torch.arange(k, dtype=torch.int32) // group
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = torch.arange(k, dtype=torch.int32) // group
    return g_idx


def pack_linear(w: torch.Tensor, method: str, group: int, sym: bool, act_order: bool,
                fmt: str, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One float weight (N, K) -> (its checkpoint tensors by leaf name, the reference weight)."""
    k = w.shape[1]
    group = k if group == -1 else group
    g_idx = g_index(k, group, act_order, seed)
    v1 = method == "gptq" and fmt == "gptq"
    q, z, s = quantize(w, g_idx, k // group, sym, min_zero=1 if v1 else 0)
    reference = (q - z[:, g_idx.long()]).float() * s.float()[:, g_idx.long()]
    stored_z = (z - 1) if v1 else z
    if method == "awq":
        tensors = {"qweight": pack_along_columns(q.T, AWQ_PACK_ORDER),
                   "qzeros": pack_along_columns(stored_z.T, AWQ_PACK_ORDER),
                   "scales": s.T.contiguous()}
    else:
        tensors = {"qweight": pack_along_rows(q.T), "qzeros":
                   pack_along_columns(stored_z.T, tuple(range(8))),
                   "scales": s.T.contiguous(), "g_idx": g_idx}
    return tensors, reference


def write_packed_checkpoint(src: Path, dst: Path, reference: Path, *, method: str,
                            group_size: int = 32, sym: bool = False, act_order: bool = False,
                            fmt: str = "gptq") -> tuple[Path, Path]:
    """`src` (a float Qwen2/Qwen3 folder) -> (`dst` in the AWQ or GPTQ layout, `reference`:
    float32 with the weights the layout stands for)."""
    shutil.copytree(src, dst)
    shutil.copytree(src, reference)
    packed, dequantized = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        module, _, leaf = name.rpartition(".")
        linear = module.rpartition(".")[2]
        if leaf == "weight" and linear in LINEARS:
            layer = int(module.split(".")[2])
            seed = 1000 * layer + sorted(set(INPUT_OF.values())).index(INPUT_OF[linear])
            tensors, dequantized[name] = pack_linear(t, method, group_size, sym, act_order,
                                                     fmt, seed)
            packed.update({f"{module}.{leaf}": v for leaf, v in tensors.items()})
        else:
            packed[name] = dequantized[name] = t
    save_file(packed, dst / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = config_block(method, group_size, sym, act_order, fmt)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst, reference
