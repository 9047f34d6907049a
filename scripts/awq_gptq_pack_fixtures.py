"""The fixtures of tests/unit/layers/test_awq_gptq.py, written by the packers of the layouts'
own projects (references, not dependencies of ours): AutoAWQ's `WQLinear_GEMM.from_linear`
and `dequantize_gemm`, and AutoGPTQ's `QuantLinear.pack` (qlinear_cuda, v1 format: zeros
stored minus one) with its own CPU forward as the dequantizer. A weight on the quantization
grid, W = (q - z) * s with s fp16 and z >= 1 (AutoGPTQ's pack wraps a zero of 0), is packed;
the file keeps q, z, s, the packed tensors (as each project saves them) and each project's dequantized weight (K, N).

Run it where the two import (their sources unpacked; neither needs its CUDA extension here):

    pip download --no-deps autoawq==0.2.9 && tar xzf autoawq-0.2.9.tar.gz
    pip download --no-deps --only-binary :all: auto-gptq==0.7.1 && unzip -d agptq auto_gptq-*.whl
    python scripts/awq_gptq_pack_fixtures.py autoawq-0.2.9 agptq tests/fixtures/awq_gptq_pack
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

N, K, GROUP = 64, 128, 32            # AutoAWQ packs N // 32 * 4 words a row


def bare_package(name: str, root: Path) -> None:
    """Import `name`'s submodules without running its __init__ (which pulls in the
    project's whole model zoo)."""
    module = types.ModuleType(name)
    module.__path__ = [str(root / name)]
    sys.modules[name] = module


def grid(g_idx: torch.Tensor, sym: bool) -> tuple[torch.Tensor, ...]:
    """(q (N, K), z (N, K / G), s (N, K / G) fp16, W (N, K) float32) on the grid."""
    torch.manual_seed(0)
    q = torch.randint(0, 16, (N, K))
    z = torch.full((N, K // GROUP), 8) if sym else torch.randint(1, 16, (N, K // GROUP))
    s = (torch.rand(N, K // GROUP) * 0.05 + 0.001).half()
    w = (q - z[:, g_idx.long()]).float() * s.float()[:, g_idx.long()]
    return q, z, s, w


def awq(root: Path) -> dict[str, torch.Tensor]:
    bare_package("awq", root)
    gemm = importlib.import_module("awq.modules.linear.gemm")
    packing = importlib.import_module("awq.utils.packing_utils")
    q, z, s, w = grid(torch.arange(K) // GROUP, sym=False)
    linear = torch.nn.Linear(K, N, bias=False)
    linear.weight.data = w
    layer = gemm.WQLinear_GEMM.from_linear(linear, 4, GROUP, scales=s.T.float(), zeros=z.T)
    deq = packing.dequantize_gemm(layer.qweight, layer.qzeros, layer.scales, 4, GROUP)
    return {"q": q.to(torch.int8), "z": z.to(torch.int8), "s": s, "qweight": layer.qweight,
            "qzeros": layer.qzeros, "scales": layer.scales, "dequantized": deq}


def gptq(root: Path, act_order: bool, sym: bool) -> dict[str, torch.Tensor]:
    bare_package("auto_gptq", root)
    qlinear = importlib.import_module("auto_gptq.nn_modules.qlinear.qlinear_cuda")
    g_idx = torch.arange(K, dtype=torch.int32) // GROUP
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(1))]
    q, z, s, w = grid(g_idx, sym)
    linear = torch.nn.Linear(K, N, bias=False)
    linear.weight.data = w
    layer = qlinear.QuantLinear(4, GROUP, K, N, bias=False, weight_dtype=torch.float32)
    layer.pack(linear, s.float(), z.float(), g_idx=g_idx)
    with torch.no_grad():
        deq = layer(torch.eye(K))                                         # (K, N) = x W^T
    return {"q": q.to(torch.int8), "z": z.to(torch.int8), "s": s, "qweight": layer.qweight,
            "qzeros": layer.qzeros, "scales": layer.scales.half(), "g_idx": layer.g_idx,
            "dequantized": deq}


def main(awq_root: str, gptq_root: str, out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    meta = {"group_size": str(GROUP)}
    for name, tensors in (("awq_gemm", awq(Path(awq_root))),
                          ("gptq_v1", gptq(Path(gptq_root), act_order=False, sym=False)),
                          ("gptq_v1_act_order_sym", gptq(Path(gptq_root), act_order=True,
                                                         sym=True))):
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  f"{out}/{name}.safetensors", metadata=meta)


if __name__ == "__main__":
    main(*sys.argv[1:4])
