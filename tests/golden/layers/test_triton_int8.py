"""The INT8 kernels of layers/triton_int8.py against exact references: the row quantization
against layers/int8.py's PyTorch form (identical int8 values, the same scales), the matmul
against the integer product computed exactly (int64), scaled in float64. On a GPU the kernels
are compiled; without one they run in Triton's interpreter on CPU tensors, in a child process
(TRITON_INTERPRET must be set before `import torch`, which imports triton)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from omnistage.testing.interpreter import (INTERPRETING, patch_interpreter,  # noqa: E402
                                           run_in_interpreter)

from omnistage.layers import int8, triton_int8  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS_HERE = torch.cuda.is_available() or INTERPRETING
kernel_test = pytest.mark.skipif(not KERNELS_HERE, reason="runs in the interpreter child")
SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2)
# the TMA kernel (tensor descriptors) needs a Hopper GPU or newer; the interpreter runs it
HAS_TMA = not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (9, 0)
TMA = [0, pytest.param(1, marks=pytest.mark.skipif(not HAS_TMA, reason="TMA: sm_90+"))]

if DEVICE.type == "cpu" and KERNELS_HERE:
    patch_interpreter()


@pytest.mark.skipif(KERNELS_HERE, reason="the kernels run in this process")
def test_kernels_in_triton_interpreter() -> None:
    """Re-run this file with TRITON_INTERPRET=1 in a child process (CPU only)."""
    run_in_interpreter(__file__, timeout_s=300)


def _rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows (7, 80) of varied scale, one of zeros, two whose quotients hit ties at .5 (amax
    127 -> scale 1; amax 63.5 -> scale 0.5), as a strided slice of a wider tensor."""
    torch.manual_seed(0)
    rows = torch.randn(7, 80) * torch.tensor([1.0, 1e-3, 30.0, 0.2, 1.0, 1.0, 5.0])[:, None]
    rows[1] = 0.0
    rows[4, :12] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5,
                                 -127.0, 3.5, -4.5])
    rows[4, 12:] = torch.randint(-126, 127, (68,)).float()
    rows[5, :6] = torch.tensor([63.5, 0.25, 0.75, -1.25, 10.25, -0.25])
    rows[5, 6:] = torch.randint(-100, 100, (74,)).float() / 2
    wide = torch.randn(7, 96)
    wide[:, 8:88] = rows
    return wide.to(DEVICE, dtype)[:, 8:88]


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("row_block", [triton_int8.MAX_ROW_BLOCK, 32])
def test_quantize_rows_int8_matches_pytorch(dtype: torch.dtype, row_block: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Identical q and scales; row_block 32 takes the tiled two-pass form (80 = 32+32+16)."""
    monkeypatch.setattr(triton_int8, "MAX_ROW_BLOCK", row_block)
    x = _rows(dtype)
    assert x.stride(0) == 96 and not x.is_contiguous()
    q, scale = triton_int8.quantize_rows_int8(x)
    ref_q, ref_scale = int8.quantize_rows_int8(x)
    assert q.dtype == torch.int8 and q.is_contiguous() and scale.shape == (7, 1)
    ties = (x.float() / ref_scale).frac().abs() == 0.5
    assert ties[4].sum() >= 8 and ties[5].sum() >= 4, "the tie rows must tie"
    assert torch.equal(q, ref_q), (q != ref_q).nonzero()
    torch.testing.assert_close(scale, ref_scale, rtol=1e-7, atol=0)
    assert (q[1] == 0).all() and q[4, 0] == 127 and q[4, 9] == -127


def _reference(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
               bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact result (float64) and the float32 rounding bound of the kernel's epilogue:
    three float32 roundings (* sx, * sw, + bias) of values at most |prod| + |bias|."""
    acc = (xq.long().cpu() @ w.long().cpu().T).double()                # exact
    prod = acc * sx.double().cpu() * sw.double().cpu().reshape(1, -1)
    b = torch.zeros(prod.shape[1], dtype=torch.float64) if bias is None else bias.double().cpu()
    return prod + b, 2.0**-22 * (prod.abs() + b.abs())


def _check(got: torch.Tensor, want: torch.Tensor, f32_bound: torch.Tensor) -> None:
    """got within the float32 bound, plus one rounding to got's dtype when it is bf16 (one
    bf16 spacing at the value: the GPU rounds to nearest, the interpreter truncates)."""
    g = got.double().cpu()
    bound = f32_bound.clone()
    if got.dtype == torch.bfloat16:
        top = torch.maximum(g.abs(), want.abs()).clamp(min=1e-30)
        bound += torch.exp2(torch.floor(torch.log2(top)) - 7)
    err = (g - want).abs()
    assert (err <= bound).all(), f"worst {(err - bound).max().item()} over, at " \
                                 f"{(err - bound).argmax().item()}"


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    xq = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    sx = torch.rand(m, 1, generator=gen) / 127 + 1e-3
    sw = torch.rand(n, generator=gen) / 127 + 1e-3
    bias = torch.randn(n, generator=gen) * 50
    return tuple(t.to(DEVICE) for t in (xq, sx, w, sw, bias))


@kernel_test
@pytest.mark.parametrize("m", [1, 7, 33, 130])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tma", TMA)
def test_int8_matmul_exact_reference(m: int, has_bias: bool, out_dtype: torch.dtype,
                                     tma: int) -> None:
    """N 80 (not a multiple of BLOCK_N 32), K 64 (two K tiles) with small tiles."""
    xq, sx, w, sw, bias = _operands(m, 80, 64, seed=m)
    bias = bias if has_bias else None
    got = triton_int8.int8_matmul(xq, sx, w, sw, bias, out_dtype, cfg={**SMALL, "TMA": tma})
    assert got.shape == (m, 80) and got.dtype == out_dtype
    _check(got, *_reference(xq, sx, w, sw, bias))


@kernel_test
@pytest.mark.parametrize("tma", TMA)
def test_int8_matmul_layouts(tma: int) -> None:
    """K 48 (not a multiple of BLOCK_K: the masked K loop), xq rows strided (a slice), sw
    (1, N), a bf16 bias."""
    xq, sx, w, sw, bias = _operands(9, 48, 48, seed=3)
    wide = torch.zeros(9, 80, dtype=torch.int8, device=DEVICE)
    wide[:, 16:64] = xq
    bias16 = bias.to(torch.bfloat16)
    got = triton_int8.int8_matmul(wide[:, 16:64], sx, w, sw.view(1, -1), bias16,
                                  torch.float32, cfg={**SMALL, "TMA": tma})
    _check(got, *_reference(xq, sx, w, sw, bias16))


@kernel_test
@pytest.mark.parametrize("m, n, k", [(3, 32, 64), (130, 96, 64)])
def test_int8_matmul_default_config(m: int, n: int, k: int) -> None:
    """The table's own tiles (16 x 32 x 64; 128 x 128 x 64, N and M edges masked), and the
    quantization in front: x -> quantize_rows_int8 -> int8_matmul against the same math."""
    torch.manual_seed(m)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    _, _, w, sw, bias = _operands(m, n, k, seed=m + 1)
    xq, sx = triton_int8.quantize_rows_int8(x)
    got = triton_int8.int8_matmul(xq, sx, w, sw, bias)
    _check(got, *_reference(xq, sx, w, sw, bias))


def test_config_table() -> None:
    """Every config the table gives is one int8 tl.dot takes (BLOCK_K >= 32, powers of two,
    BLOCK_N >= 16) and fits an H100 / H200 block's shared memory; Qwen-Image's shapes get the
    large tile."""
    for m in (1, 7, 16, 17, 64, 65, 300, 4096, 8192):
        for n, k in ((16, 16), (96, 48), (3072, 3072), (12288, 3072), (3072, 12288)):
            cfg = triton_int8.config(m, n, k)
            bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
            assert all(b & (b - 1) == 0 for b in (bm, bn, bk)), cfg
            assert bk >= 32 and bn >= 16 and bm >= 16, cfg
            assert cfg["num_stages"] * (bm + bn) * bk <= 227 * 1024, cfg
    assert triton_int8.config(4096, 3072, 3072) == dict(
        BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)


@kernel_test
def test_int8_linear_takes_the_kernels_and_equals_its_eager_form(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Int8Linear on the fused kernels' device (CUDA; here the interpreter) runs its one
    custom op (quantize, matmul with scales and bias) and gives its eager form's output up to
    the epilogue's rounding: the same int8 values, the same scales, for a (2, 5, 64) input."""
    from omnistage.layers import fused

    torch.manual_seed(4)
    dense = torch.nn.Linear(64, 48).to(DEVICE)
    layer = int8.Int8Linear.from_linear(dense)
    x = torch.randn(2, 5, 64, device=DEVICE)
    monkeypatch.setattr(fused, "_enabled", False)            # the eager form first
    want = layer(x)
    monkeypatch.setattr(fused, "_enabled", True)
    monkeypatch.setattr(fused, "_interpret", DEVICE.type == "cpu")
    calls = []
    monkeypatch.setattr(int8, "int8_matmul", lambda *a: calls.append(a))   # not taken
    got = layer(x)
    assert not calls and got.shape == want.shape == (2, 5, 48)
    assert want.abs().mean() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
