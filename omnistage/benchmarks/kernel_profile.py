"""Where one forward's device time goes: kernels grouped by kind (matmul, FP8 matmul, attention,
norm / modulation, rotary, ...) by torch.profiler, and the FLOPs of its linears, from which the
matmuls' rate follows. Used by `omnistage bench diffusion --kernel-profile` and the model
variants (diffusion_variants.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch import Tensor, nn

Forward = Callable[[Tensor, Tensor], Tensor]
# kernel kinds, first match wins (lower-case substrings of the kernel's name)
KINDS = (("attention", ("flash", "fmha", "attention", "sdpa", "mha")),
         ("fp8 quantize", ("quantize", "amax")),
         ("fp8 matmul", ("e4m3", "float8", "fp8", "f8f8")),
         ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "addmm",
                     "triton_tem")),
         ("rotary", ("rope", "rotary")),
         ("norm / modulation", ("norm", "modulat", "rms")),
         ("gated residual", ("gated",)),
         ("copy / layout", ("copy", "cat", "transpose", "contiguous", "clone", "memcpy",
                            "memset", "index")),
         ("elementwise, inductor-fused", ("triton_poi", "triton_red", "triton_per")),
         ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce", "gelu", "silu")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def kernel_profile(forward: Forward, x: Tensor, t: Tensor, flops: int | None
                   ) -> dict[str, object]:
    """The device time of one forward by kernel kind (ms), the top kernels, and the matmuls'
    rate where the linear FLOPs are known. On the CPU: operator CPU time (the tiny runs)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = x.is_cuda
    with torch.inference_mode():
        forward(x, t)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            forward(x, t)
            if cuda:
                torch.cuda.synchronize()
    kinds: Counter[str] = Counter()
    names: Counter[str] = Counter()
    for event in prof.key_averages():
        ms = (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1000
        if ms > 0:
            kinds[kind_of(event.key)] += ms
            names[event.key[:120]] += ms
    matmul = kinds["matmul"] + kinds["fp8 matmul"]
    return {"total_ms": sum(kinds.values()), "by_kind_ms": dict(kinds.most_common()),
            "top_kernels_ms": dict(names.most_common(10)),
            "matmul_tflops": flops / matmul / 1e9 if flops and matmul else None}


def linear_flops(model: nn.Module, forward: Forward, x: Tensor, t: Tensor) -> int:
    """2 x rows x in x out summed over every linear a forward runs (hooks on 2-D weights)."""
    total = 0

    def hook(module: nn.Module, args: tuple) -> None:
        nonlocal total
        n, k = module.weight.shape
        total += 2 * (args[0].numel() // k) * n * k

    handles = [m.register_forward_pre_hook(hook) for m in model.modules()
               if isinstance(getattr(m, "weight", None), Tensor) and m.weight.dim() == 2
               and not isinstance(m, nn.Embedding)]
    try:
        with torch.inference_mode():
            forward(x, t)
    finally:
        for h in handles:
            h.remove()
    return total
