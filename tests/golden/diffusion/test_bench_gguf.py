"""`omnistage bench diffusion --quantization gguf` (diffusion_gguf.py): its torch Q8_0 / Q4_0
quantizers bit for bit against `gguf.quants.quantize`, and the tiny preset on the CPU (float32,
no diffusers): Q8_0 lands near our unquantized image and nearer than Q4_0, the quantized
linears weigh exactly 34/64 and 18/64 of bf16, and the issue's headline fields are there."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from omnistage.benchmarks import diffusion
from omnistage.benchmarks.common import seeded_init
from omnistage.benchmarks.diffusion_gguf import (Q4_0, Q8_0, bench_gguf, eligible_linears,
                                                 quantize)
from omnistage.layers.gguf import GGUFLinear, dequantize
from omnistage.models.qwen_image_transformer import (QwenImageTransformer2DModel,
                                                     QwenImageTransformerConfig)

gguf = pytest.importorskip("gguf")


def awkward_weights() -> torch.Tensor:
    """(8, 256) float32: random rows, a zero block, roundf's ties (d = 1 exactly: x.5 rounds
    away from zero), a block whose largest magnitude is there with both signs (the first
    one decides d's sign), and bf16-valued rows (what the GPU run quantizes)."""
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    w[0, :32] = 0
    w[1, :32] = torch.tensor([127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5] + [3.0] * 25)
    w[2, :32] = 0.01
    w[2, 5], w[2, 9] = -0.3, 0.3
    w[4:] = w[4:].to(torch.bfloat16).float()
    return w


@pytest.mark.parametrize("qtype", [Q8_0, Q4_0], ids=["Q8_0", "Q4_0"])
def test_quantize_matches_gguf(qtype: int) -> None:
    w = awkward_weights()
    ours = quantize(w, qtype)
    ref = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(qtype))
    assert ours.dtype == torch.uint8 and ours.shape == ref.shape
    np.testing.assert_array_equal(ours.numpy(), ref)
    # and layers/gguf.py reads them back within a block's step d: half of it for Q8_0 (plus
    # d's float16 rounding times |q| <= 127), a whole one for Q4_0 (q = 8 clips to 7)
    back = dequantize(ours, qtype)
    d = w.reshape(-1, 32).abs().amax(1, keepdim=True) / (127 if qtype == Q8_0 else 8)
    bound = d * (0.5 + 127 * 2.0 ** -11 if qtype == Q8_0 else 1 + 8 * 2.0 ** -11)
    assert bool(((back - w).abs().reshape(-1, 32) <= bound + 1e-7).all())
    assert float((back - w).abs().max()) > 0                        # it did quantize


def test_quantize_refuses_what_it_cannot_write() -> None:
    with pytest.raises(ValueError, match="no quantizer"):
        quantize(torch.zeros(4, 256), 12)                      # Q4_K: gguf 0.19 cannot either
    with pytest.raises(AssertionError, match="multiple of 32"):
        quantize(torch.zeros(4, 48), Q8_0)


def test_split_quantization_takes_gguf() -> None:
    assert diffusion.split_quantization("gguf") == ("gguf", None)
    assert diffusion.split_quantization("transformer=gguf") == ("gguf", None)
    with pytest.raises(ValueError, match="gguf"):
        diffusion.split_quantization("transformer=gguf,attention=fp8")


def tiny_transformer(cfg: diffusion.DiffusionBenchConfig) -> QwenImageTransformer2DModel:
    model = QwenImageTransformer2DModel(QwenImageTransformerConfig.from_dict(cfg.transformer))
    seeded_init(model, cfg.seed)
    return model.eval()


def test_bench_gguf_tiny() -> None:
    cfg = diffusion.DiffusionBenchConfig.preset("tiny", device="cpu", quantization="gguf",
                                                cache_thresholds=(0.5,), concurrency=1)
    device, dtype = torch.device("cpu"), torch.float32
    ours = tiny_transformer(cfg)
    names = eligible_linears(ours)
    _, text, _ = diffusion.denoiser_inputs(cfg, device, dtype)
    _, image = diffusion.bench_engine(ours, text[0], cfg, device, dtype)   # the bf16 image
    out = bench_gguf(ours, image, {"diffusers_s": 1.0}, cfg, device, dtype)
    ratios = out["ratios"]

    # every linear with inputs in whole blocks, the two of 16 inputs (img_in, txt_in) kept
    assert out["num_gguf_linears"] == len(names) > 20 and out["num_linears_kept"] == 2
    assert out["formats"] == {"q8": "Q8_0", "q4": "Q4_0"}
    assert ratios["gguf_q8_linears_memory_ratio"] == 34 / 64
    assert ratios["gguf_q4_linears_memory_ratio"] == 18 / 64
    for key in ("q8", "q4"):           # the rest (biases, norms, 2 linears) stays at bf16
        assert math.isclose(out[f"weights_gib_{key}"], out["weights_gib_bf16"]
                            - out["linears_gib_bf16"] + out[f"linears_gib_{key}"])
    assert 34 / 64 < ratios["gguf_q8_memory_ratio"] < 0.6
    assert 18 / 64 < ratios["gguf_q4_memory_ratio"] < 0.35

    # Q8_0 near the unquantized run, Q4_0 farther yet still close
    assert ratios["gguf_q8_latents_psnr_db"] > ratios["gguf_q4_latents_psnr_db"] + 15
    assert ratios["gguf_q8_image_psnr_db"] > ratios["gguf_q4_image_psnr_db"] + 10
    assert ratios["gguf_q8_image_psnr_db"] > 45 and ratios["gguf_q4_image_psnr_db"] > 25
    assert out["q8"]["engine"]["pixel_error"]["max"] <= out["q4"]["engine"]["pixel_error"]["max"]
    for key in ("gguf_q8_speedup_vs_bf16", "gguf_q4_speedup_vs_bf16",
                "gguf_q8_speedup_vs_diffusers", "gguf_q4_speedup_vs_diffusers"):
        assert ratios[key] > 0, key
    assert ratios["gguf_q8_speedup_vs_diffusers_compiled"] is None    # not timed here

    # the transformer ends in Q4_0: each linear's blocks are gguf's of the seeded weight
    fresh = tiny_transformer(cfg)
    for name in names:
        layer = ours.get_submodule(name)
        assert isinstance(layer, GGUFLinear) and layer.qtype == Q4_0, name
        ref = gguf.quants.quantize(fresh.get_submodule(name).weight.detach().numpy(),
                                   gguf.GGMLQuantizationType.Q4_0)
        np.testing.assert_array_equal(layer.qweight.numpy(), ref)
