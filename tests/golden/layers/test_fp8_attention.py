"""The FP8 attention kernel (layers/fp8_attention.py) against its float32 emulation (tight:
the same quantized Q and K, only float32 summation order apart) and against float32 SDPA
(loose: what e4m3 Q and K cost), at odd lengths, batch 2, several heads, key masks. On a GPU
the kernel is compiled; without one it runs in Triton's interpreter on CPU tensors in a child
process (TRITON_INTERPRET must be set before `import torch`).

What the interpreter cannot check (tests/gpu/test_fp8_attention_cuda.py does): bf16 V (the
interpreter stores bf16 as uint16 and its tl.dot on them is garbage, so V and the output are
float32 here; the P V dot then runs in float32) and the compiled fp8 tensor-core path. The
e4m3 Q K^T dot itself is exact in the interpreter (products of e4m3 values are exact)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from omnistage.layers.fp8_attention import (FP8_MAX, Tiles, fp8_attention,  # noqa: E402
                                            fp8_attention_reference, quantize_heads)
from omnistage.layers.sequence_parallel import sdpa  # noqa: E402
from omnistage.testing.interpreter import (INTERPRETING, patch_interpreter,  # noqa: E402
                                           run_in_interpreter)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS_HERE = torch.cuda.is_available() or INTERPRETING
kernel_test = pytest.mark.skipif(not KERNELS_HERE, reason="runs in the interpreter child")
TILES = Tiles(64, 64, 4, 1)      # few loop steps: the interpreter's time goes per step

if DEVICE.type == "cpu" and KERNELS_HERE:
    patch_interpreter()


@pytest.mark.skipif(KERNELS_HERE, reason="the kernels run in this process")
def test_kernels_in_triton_interpreter() -> None:
    """Re-run this file with TRITON_INTERPRET=1 in a child process (CPU only)."""
    run_in_interpreter(__file__)


def make_qkv(b: int, h: int, len_q: int, len_k: int, d: int, seed: int,
             dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Random q, k, v (B, H, S, D); keys with a shared offset (what smoothing removes) and a
    ramp along the sequence, so that later key tiles raise the running max."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, len_q, d, generator=gen)
    k = torch.randn(b, h, len_k, d, generator=gen) + torch.randn(1, h, 1, d, generator=gen)
    k = k * torch.linspace(0.5, 2.0, len_k)[:, None]
    v = torch.randn(b, h, len_k, d, generator=gen)
    return tuple(t.to(DEVICE, dtype) for t in (q, k, v))


def padding_mask(b: int, len_k: int, lengths: list[int]) -> torch.Tensor:
    """(B, Sk) True on each row's first lengths[i] keys (a padded caption)."""
    return (torch.arange(len_k)[None, :] < torch.tensor(lengths)[:, None]).to(DEVICE)


def sdpa_fp32(q, k, v, mask=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    mask = None if mask is None else mask[:, None, None, :]
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)


@kernel_test
@pytest.mark.parametrize("b, h, len_q, len_k, d, masked", [
    (2, 3, 77, 77, 64, False),
    (2, 2, 333, 333, 128, True),
    (2, 1, 1030, 1030, 64, False),          # 1000+: one head, for the interpreter's time
    (2, 2, 100, 333, 64, True),            # cross attention: more keys than queries
])
def test_kernel_matches_emulation_and_sdpa(b: int, h: int, len_q: int, len_k: int, d: int,
                                           masked: bool) -> None:
    q, k, v = make_qkv(b, h, len_q, len_k, d, seed=len_q + d)
    mask = padding_mask(b, len_k, [len_k - 5, len_k // 3]) if masked else None
    out = fp8_attention(q, k, v, mask, tiles=TILES)
    emulated = fp8_attention_reference(q, k, v, mask)
    assert out.shape == (b, h, len_q, d) and out.dtype == v.dtype
    # tight: one quantization, float32 sums in another order (measured ~3e-7)
    torch.testing.assert_close(out, emulated, atol=2e-5, rtol=1e-4)
    exact = sdpa_fp32(q, k, v, mask)
    err = (out.float() - exact).abs()
    # loose: e4m3 Q and K (3 mantissa bits) move the scores by a few percent of their size;
    # measured max 0.10-0.19, mean 0.005-0.011, cosine 0.9985-0.9987 (bf16 SDPA: max 0.015,
    # mean 0.001) on unit-variance V with peaked (ramped) keys
    assert err.max() < 0.3 and err.mean() < 0.02, (err.max(), err.mean())
    assert F.cosine_similarity(out.flatten(), exact.flatten(), dim=0) > 0.997


@kernel_test
def test_rows_without_keys_are_zero_and_other_rows_unaffected() -> None:
    q, k, v = make_qkv(2, 2, 70, 90, 64, seed=3)
    mask = padding_mask(2, 90, [90, 0])                   # batch 1 has no key to attend to
    out = fp8_attention(q, k, v, mask, tiles=TILES)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    alone = fp8_attention(q[:1], k[:1], v[:1], None, tiles=TILES)
    torch.testing.assert_close(out[:1], alone, atol=1e-6, rtol=1e-6)


@kernel_test
@pytest.mark.parametrize("tiles", [Tiles(32, 16, 1, 1), Tiles(16, 64, 4, 2)])
def test_tiles_do_not_change_the_result(tiles: Tiles) -> None:
    q, k, v = make_qkv(2, 2, 71, 83, 64, seed=5)
    torch.testing.assert_close(fp8_attention(q, k, v, tiles=tiles),
                               fp8_attention_reference(q, k, v), atol=2e-5, rtol=1e-4)


def test_quantize_heads_scale_and_rounding() -> None:
    """One scale per (batch, head): its largest magnitude lands on 448, every value within
    e4m3's half step (2^-4 relative, subnormals 2^-10 of the scale)."""
    x = torch.randn(2, 3, 50, 64) * torch.tensor([1.0, 10.0, 0.01])[None, :, None, None]
    x8, scale = quantize_heads(x.bfloat16())
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape and scale.shape == (2, 3)
    xb = x.bfloat16().float()
    amax = xb.abs().amax(dim=(2, 3))
    torch.testing.assert_close(scale, amax / FP8_MAX)
    assert torch.equal(x8.float().abs().amax(dim=(2, 3)), torch.full((2, 3), FP8_MAX))
    back = x8.float() * scale[:, :, None, None]
    assert (back - xb).abs().le(xb.abs() * 2 ** -4 + scale[:, :, None, None] * 2 ** -10).all()


def test_smoothed_scale_is_the_amax_of_the_difference() -> None:
    """quantize_heads(x, mean) takes its scale from x's max and min (no float32 copy): the
    same value as the largest |x - mean| computed element by element, and the values are
    x - mean's."""
    x = (torch.randn(2, 3, 70, 64) * 3 + 5).bfloat16()
    mean = x.mean(dim=2, keepdim=True, dtype=torch.float32)
    x8, scale = quantize_heads(x, mean)
    diff = x.float() - mean
    assert torch.equal(scale, diff.abs().amax(dim=(2, 3)).clamp(min=1e-12) / FP8_MAX)
    assert torch.equal(x8, quantize_heads(diff)[0])


@pytest.mark.parametrize("len_q, len_k, masked", [(77, 77, False), (333, 400, True),
                                                  (1030, 1030, False)])
def test_emulation_close_to_sdpa(len_q: int, len_k: int, masked: bool) -> None:
    """The emulation (the CPU path) in bf16 against float32 SDPA: the error of e4m3 Q and K,
    not more (a wrong scale or a lost smoothing would be far off: keys carry a large shared
    offset here, which without smoothing takes most of e4m3's range)."""
    q, k, v = (t.cpu() for t in make_qkv(2, 3, len_q, len_k, 128, seed=len_q))
    k = k + 8.0
    mask = padding_mask(2, len_k, [len_k, len_k // 2]).cpu() if masked else None
    out = fp8_attention_reference(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert out.dtype == torch.bfloat16
    exact = sdpa_fp32(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    err = (out.float() - exact).abs()
    assert err.max() < 0.3 and err.mean() < 0.02, (err.max(), err.mean())
    cos = F.cosine_similarity(out.float().flatten(), exact.flatten(), dim=0)
    assert cos > 0.997, cos


def test_dit_sdpa_takes_the_fp8_path() -> None:
    """layers/sequence_parallel.sdpa with method "fp8" (what a DiT built under
    `dit_attention("fp8")` calls): (B, S, H, D) in and out, the emulation on CPU."""
    q, k, v = (t.cpu().transpose(1, 2) for t in make_qkv(2, 2, 40, 40, 32, seed=1))
    mask = padding_mask(2, 40, [40, 17]).cpu()
    got = sdpa(q, k, v, mask, "fp8")
    want = fp8_attention_reference(*(t.transpose(1, 2) for t in (q, k, v)), mask)
    assert torch.equal(got, want.transpose(1, 2))
    assert not torch.equal(got, sdpa(q, k, v, mask))


def test_refusals() -> None:
    q = torch.zeros(1, 1, 8, 48)
    with pytest.raises(ValueError, match=r"head_dim 48 is not one of \(64, 128, 256\)"):
        fp8_attention(q, q, q)
    q = torch.zeros(1, 1, 8, 64)
    with pytest.raises(ValueError, match=r"key masks \(B, Sk\) = \(1, 8\), not a mask of "
                                         r"shape \(1, 1, 8, 8\)"):
        fp8_attention(q, q, q, torch.ones(1, 1, 8, 8, dtype=torch.bool))
    assert Tiles.parse("128,64,8,3") == Tiles(128, 64, 8, 3)
    with pytest.raises(ValueError, match="block_n: 48 is not a power of two"):
        Tiles.parse("64,48,4,2")
    with pytest.raises(ValueError, match="expected BLOCK_M,BLOCK_N,NUM_WARPS,NUM_STAGES"):
        Tiles.parse("64,64")
