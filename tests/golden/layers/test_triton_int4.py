"""The 4-bit matrix-vector kernel (triton_int4.py: packed words and group scales dequantized in
registers) against the per-call path it replaces for few rows, the dequantized weight's matmul
(layers/int4.py). On a GPU the kernel is compiled and also checked in bfloat16; without one it
runs in Triton's interpreter on CPU tensors, in a child process (TRITON_INTERPRET must be set
before `import torch`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from omnistage.testing.interpreter import (INTERPRETING, patch_interpreter,  # noqa: E402
                                           run_in_interpreter)

from omnistage.layers import fused  # noqa: E402
from omnistage.layers.int4 import Int4Linear, dequantize_int4, quantize_int4  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS_HERE = torch.cuda.is_available() or INTERPRETING
kernel_test = pytest.mark.skipif(not KERNELS_HERE, reason="runs in the interpreter child")
DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

if DEVICE.type == "cpu" and KERNELS_HERE:
    patch_interpreter()


@pytest.mark.skipif(KERNELS_HERE, reason="the kernels run in this process")
def test_kernels_in_triton_interpreter() -> None:
    """Re-run this file with TRITON_INTERPRET=1 in a child process (CPU only)."""
    run_in_interpreter(__file__)


@pytest.fixture
def kernels_on():
    fused._interpret = DEVICE.type == "cpu"
    yield
    fused._interpret = False


def _layer(n: int, k: int, group: int, dtype: torch.dtype, scale_dtype: torch.dtype,
           bias: bool) -> Int4Linear:
    torch.manual_seed(n * k + group)
    weight = torch.randn(n, k) * torch.linspace(0.2, 2.0, k)   # groups of unequal range
    packed, scale = quantize_int4(weight, group, scale_dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    return Int4Linear(packed, scale, k, group, b).to(DEVICE)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, group", [(37, 100, 32), (24, 200, 128), (40, 1100, 128),
                                         (33, 520, 32)])
def test_kernel_equals_the_dequantized_matmul(kernels_on, dtype: torch.dtype, n: int, k: int,
                                              group: int) -> None:
    """Odd N, K not whole words (100) or tiles (1100: five tiles of 256), groups of 32 and
    128 (one group cut short), 1 to 4 rows, bf16 scales, with and without a bias."""
    from omnistage.layers import triton_int4

    for rows in (1, 2, 3, 4):
        layer = _layer(n, k, group, dtype, torch.bfloat16, bias=rows % 2 == 1)
        x = torch.randn(rows, k).to(DEVICE, dtype)
        # against float32 products of the same weight: in bfloat16 the per-call path rounds
        # every dequantized weight to bfloat16 first (the kernel keeps them in float32), an
        # error that grows with K (an H200 saw 0.1 at 2 of a row of magnitude ~20, K 520)
        bias = None if layer.bias is None else layer.bias.float()
        want = F.linear(x.float(), layer.dequantized(torch.float32), bias)
        got = triton_int4.linear(x, layer.weight_packed, layer.weight_scale, group, layer.bias)
        assert got.shape == (rows, n) and got.dtype == dtype
        tol = TOL[dtype]["atol"] * max(1.0, float(want.abs().max()))   # output's scale
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=TOL[dtype]["rtol"])
        assert want.abs().mean() > 0.5                             # not a near-zero output


@kernel_test
def test_scales_in_the_model_dtype_and_strided_rows(kernels_on) -> None:
    """float32 scales (a checkpoint's bf16 ones loaded into a float32 model), and rows that
    are a slice of a wider tensor."""
    from omnistage.layers import triton_int4

    layer = _layer(19, 64, 32, torch.float32, torch.float32, bias=False)
    wide = torch.randn(3, 96, device=DEVICE)
    x = wide[:, 16:80]                                             # stride 96, K 64
    want = x @ dequantize_int4(layer.weight_packed, layer.weight_scale, 64, 32).T
    got = triton_int4.linear(x, layer.weight_packed, layer.weight_scale, 32)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@kernel_test
def test_layer_takes_the_kernel_for_few_rows(kernels_on, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """Int4Linear: 1 to 4 rows through the kernel, more (prefill) through the dequantized
    matmul, the same outputs either way; a group not of whole words never takes it."""
    from omnistage.layers import triton_int4

    calls = []
    real = triton_int4.linear
    monkeypatch.setattr(triton_int4, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer = _layer(21, 96, 32, torch.float32, torch.bfloat16, bias=True)
    for rows, kernel in ((1, True), (4, True), (5, False)):
        calls.clear()
        x = torch.randn(rows, 96, device=DEVICE)
        got = layer(x)
        assert bool(calls) == kernel, (rows, calls)
        torch.testing.assert_close(got, F.linear(x, layer.dequantized(x.dtype), layer.bias),
                                   **TOL[torch.float32])
    calls.clear()
    fused._interpret, enabled = False, DEVICE.type == "cuda"
    layer(torch.randn(1, 96, device=DEVICE))                       # CPU without the flag:
    assert bool(calls) == enabled                                  # the PyTorch path


@kernel_test
def test_model_decode_through_the_kernel(kernels_on, tmp_path: Path) -> None:
    """A one-row step of the tiny Qwen3 loaded from its W4A16 checkpoint takes the kernel in
    every quantized linear (the fused one-row kernels decline an int32 weight) and gives the
    logits of the PyTorch path."""
    from omnistage.layers import triton_int4
    from omnistage.models.loader import load_model
    from omnistage.testing.tiny_models import PagedCache, build_tiny_checkpoint
    from tests.helpers.int4_checkpoint import write_int4_checkpoint

    src = build_tiny_checkpoint(tmp_path / "float", "Qwen3ForCausalLM")
    packed, _ = write_int4_checkpoint(src, tmp_path / "int4", tmp_path / "reference")
    model, _, _ = load_model(packed, DEVICE, torch.float32)
    calls = []
    real = triton_int4.linear

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*a, **k)

    def step() -> torch.Tensor:
        hidden, _ = PagedCache(model).run(model, [(0, torch.tensor([7], device=DEVICE))])
        with torch.no_grad():
            return model.compute_logits(hidden[0])

    triton_int4.linear = counted
    try:
        got = step()
    finally:
        triton_int4.linear = real
    assert len(calls) == 2 * 4, calls
    fused._interpret = False
    fused.set_enabled(DEVICE.type == "cpu")     # on a GPU: everything back to PyTorch
    try:
        want = step()
    finally:
        fused.set_enabled(True)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
