"""INT8 W8A8 linears (layers/int8.py): one layer against the float matmul of the same
quantized operands (exact up to float32 summation), then the error they cost a whole model: a
tiny FLUX.1 and Qwen-Image transformer (the same random weights as the FP8 test), four Euler
steps, latent PSNR against float32 stated and bounded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omnistage.layers.int8 import Int8Linear, quantize_int8, quantize_rows_int8
from tests.unit.layers.test_fp8 import POLICIES, _flux_run, _psnr, _qwen_image_run, _randomize

# measured (CPU, float32 reference, seeds below): qwen-image 76.1 dB, flux 56.8 dB
MIN_PSNR_DB = 50.0


def test_linear_is_the_quantized_product() -> None:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(48, 40)
    x = torch.randn(2, 7, 48, generator=gen)
    layer = Int8Linear.from_linear(linear)
    xq, sx = quantize_rows_int8(x.reshape(-1, 48))
    wq, sw = quantize_rows_int8(linear.weight.detach())
    want = (xq.float() * sx) @ (wq.float() * sw).t() + linear.bias.detach()
    got = layer(x)
    assert got.shape == (2, 7, 40) and layer.weight.dtype == torch.int8 and layer.weight.is_contiguous()
    torch.testing.assert_close(got, want.reshape(2, 7, 40), atol=1e-5, rtol=1e-5)
    exact = linear(x).detach()
    assert 0 < (got - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("name, run", [("qwen-image", _qwen_image_run), ("flux", _flux_run)])
def test_int8_latents_close_to_float(name: str, run) -> None:
    """The same 4-step denoising with INT8 blocks (the model's fp8_keep layers stay float):
    latents above MIN_PSNR_DB of float32's, and not equal (the INT8 path did run)."""
    model = _randomize(POLICIES[name][0](), seed=0)
    gen = torch.Generator().manual_seed(1)
    latents, text = torch.randn(1, 16, 16, generator=gen), torch.randn(1, 8, 16, generator=gen)
    with torch.inference_mode():
        ref = run(model, latents, text)
        swapped = quantize_int8(model, min_features=16)
        int8 = run(model, latents, text)
    assert len(swapped) > 4 and not set(swapped) & POLICIES[name][1]
    psnr = _psnr(int8, ref)
    print(f"{name}: INT8 latent PSNR {psnr:.1f} dB")
    assert MIN_PSNR_DB < psnr < 100, psnr
