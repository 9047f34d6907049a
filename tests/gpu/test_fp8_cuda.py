"""GPU-only (skipped without an FP8 GPU, compute capability 8.9+): FP8 linears on CUDA. The
activations' one-pass quantization kernel, opaque to torch.compile as a custom op, and the
bias in `_scaled_mm`'s epilogue: eager, compiled and CUDA-graphed forwards agree, and stay
near the bf16 linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omnistage.layers.fp8 import Fp8Linear, quantize_rows
from omnistage.layers.graph_capture import ShapeGraphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with FP8 tensor cores")]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fp8_linear_eager_compiled_and_graphed() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(1024, 2048).cuda().bfloat16()
    with torch.no_grad():
        linear.bias.mul_(50)                               # a bias that shows if it is lost
    fp8 = Fp8Linear.from_linear(linear)
    x = torch.randn(3, 77, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        want, eager = linear(x), fp8(x)
        assert rel(eager, want) < 0.05
        bias_only = fp8(torch.zeros_like(x))
        torch.testing.assert_close(bias_only, linear.bias.expand_as(bias_only), atol=0.5,
                                   rtol=0.01)
        compiled = torch.compile(fp8, dynamic=True)
        torch.testing.assert_close(compiled(x), eager, atol=0.05, rtol=0.01)
        graphs = ShapeGraphs(fp8)
        for _ in range(3):                                 # eager, capture, replay
            got = graphs(x)
        assert graphs.num_replays >= 1 and torch.equal(got, eager)


def test_quantize_kernel_bytes_equal_torch_on_cuda() -> None:
    from omnistage.layers import triton_ops
    from omnistage.layers.fp8 import FP8, FP8_MAX

    x = torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16) * 7
    q, scale = triton_ops.quantize_rows_fp8(x, FP8, FP8_MAX)
    want_q, want_scale = quantize_rows(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
