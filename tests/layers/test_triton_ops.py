"""The fused Triton kernels (RMSNorm, residual add + RMSNorm, SiLU-and-mul, q/k norm + RoPE)
against the PyTorch paths they replace. On a GPU the kernels are compiled and also checked in
bfloat16; without one they run in Triton's interpreter on CPU tensors, in a child process
(TRITON_INTERPRET must be set before `import torch`, which imports triton)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from omnistage.layers import fused, triton_ops  # noqa: E402
from omnistage.layers.activation import SiluAndMul  # noqa: E402
from omnistage.layers.norm import RMSNorm  # noqa: E402
from omnistage.layers.rotary import get_rope  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS_HERE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
kernel_test = pytest.mark.skipif(not KERNELS_HERE, reason="runs in the interpreter child")
DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

if DEVICE.type == "cpu" and KERNELS_HERE:
    from triton.runtime import interpreter as _interp

    _patch_tensor = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope) -> None:  # type: ignore[no-untyped-def]
        _patch_tensor(tensor, scope)   # numpy 2 refuses int() of the 1-element scalars
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    _interp._patch_lang_tensor = _patch_lang_tensor


@pytest.mark.skipif(KERNELS_HERE, reason="the kernels run in this process")
def test_kernels_in_triton_interpreter() -> None:
    """Re-run this file with TRITON_INTERPRET=1 in a child process (CPU only)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-p", "no:cacheprovider", "-p",
         "no:warnings"], env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and " passed" in proc.stdout, \
        proc.stdout[-4000:] + proc.stderr[-2000:]


def _torch_path(fn):  # type: ignore[no-untyped-def]
    """Run fn with the fused kernels switched off (the PyTorch reference path)."""
    fused.set_enabled(False)
    try:
        return fn()
    finally:
        fused.set_enabled(True)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(48, eps=1e-5).to(DEVICE, dtype)
    norm.weight.copy_(1 + 0.1 * torch.randn(48))
    x = (3 * torch.randn(5, 48)).to(DEVICE, dtype)
    res = torch.randn(5, 48).to(DEVICE, dtype)
    ref = _torch_path(lambda: norm(x))
    torch.testing.assert_close(triton_ops.rms_norm(x, norm.weight, 1e-5), ref, **TOL[dtype])
    # strided rows (a slice of a wider tensor) and more leading dims
    wide = torch.randn(5, 80).to(DEVICE, dtype)
    torch.testing.assert_close(triton_ops.rms_norm(wide[:, 16:64], norm.weight, 1e-5),
                               _torch_path(lambda: norm(wide[:, 16:64])), **TOL[dtype])
    x3 = x.view(5, 3, 16)
    norm16 = RMSNorm(16).to(DEVICE, dtype)
    torch.testing.assert_close(triton_ops.rms_norm(x3, norm16.weight, 1e-6),
                               _torch_path(lambda: norm16(x3)), **TOL[dtype])
    normed, total = triton_ops.add_rms_norm(x, res, norm.weight, 1e-5)
    ref_normed, ref_total = _torch_path(lambda: norm.add_forward(x, res))
    assert torch.equal(total, ref_total)
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = (2 * torch.randn(7, 2 * 40)).to(DEVICE, dtype)
    ref = _torch_path(lambda: SiluAndMul()(x))
    torch.testing.assert_close(triton_ops.silu_and_mul(x), ref, **TOL[dtype])


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope(dtype: torch.dtype, qk_norm: bool) -> None:
    torch.manual_seed(2)
    num_heads, num_kv_heads, head_dim, T = 6, 2, 16, 9
    rope = get_rope(head_dim, 256, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    qkv = torch.randn(T, (num_heads + 2 * num_kv_heads) * head_dim).to(DEVICE, dtype)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q, k = q.view(T, num_heads, head_dim), k.view(T, num_kv_heads, head_dim)   # strided views
    positions = torch.randint(0, 256, (T,), device=DEVICE)
    q_norm = RMSNorm(head_dim).to(DEVICE, dtype)
    k_norm = RMSNorm(head_dim).to(DEVICE, dtype)
    q_norm.weight.copy_(1 + 0.1 * torch.randn(head_dim))
    k_norm.weight.copy_(1 + 0.1 * torch.randn(head_dim))

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        qq, kk = (q_norm(q), k_norm(k)) if qk_norm else (q, k)
        if dtype == torch.bfloat16:   # the kernel rotates in float32 with float32 cos/sin
            qq, kk = qq.float(), kk.float()
        rope._rows = None
        qr, kr = rope(positions, qq, kk)
        return qr.to(dtype), kr.to(dtype)

    ref_q, ref_k = _torch_path(reference)
    got_q, got_k = triton_ops.qk_norm_rope(
        q, k, q_norm.weight if qk_norm else None, k_norm.weight if qk_norm else None, 1e-6,
        rope.cos_cache, rope.sin_cache, positions)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    torch.testing.assert_close(got_q, ref_q, **TOL[dtype])
    torch.testing.assert_close(got_k, ref_k, **TOL[dtype])
