"""FP8 linears (layers/fp8.py) on the CPU, where torch's `_scaled_mm` runs e4m3 too: the
quantization round trip, the matmul against its dequantized emulation, Fp8Linear against the
float linear, each native DiT's policy (what stays unquantized), the weight bytes, and tiny
Qwen-Image / FLUX denoising loops whose FP8 latents stay close to float32's."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor, nn

from omnistage.layers.fp8 import (FP8, FP8_MAX, Fp8Linear, check_fp8_device, dequantize_rows,
                                  fp8_matmul, quantize_fp8, quantize_rows)
from omnistage.models.flux_transformer import FluxTransformer2DModel, FluxTransformerConfig
from omnistage.models.qwen_image_transformer import (QwenImageTransformer2DModel,
                                                     QwenImageTransformerConfig)
from omnistage.models.sd3_transformer import SD3Transformer2DModel, SD3TransformerConfig
from omnistage.models.wan_transformer import WanTransformer3DModel, WanTransformerConfig
from omnistage.models.z_image_transformer import ZImageConfig, ZImageTransformer2DModel


def rel(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def spread_rows(rows: int, cols: int, seed: int) -> Tensor:
    """Random rows whose magnitudes span 1e-2 .. 1e2, so that a scale applied to the wrong
    row (or column) is far off."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.logspace(-2, 2, rows)[torch.randperm(rows, generator=gen)]
    return torch.randn(rows, cols, generator=gen) * magnitude[:, None]


def test_quantize_rows_round_trip() -> None:
    x = spread_rows(64, 96, seed=0)
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (64, 1) and scale.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((64,), FP8_MAX))
    back = dequantize_rows(q, scale)
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of a value; below 2^-6 the subnormal
    # step 2^-9 (times the row's scale) bounds the error instead
    assert ((back - x).abs() <= x.abs() / 16 + scale * 2.0 ** -10).all()
    assert max(rel(back[i], x[i]) for i in range(64)) < 0.04


def test_fp8_matmul_equals_its_emulation() -> None:
    """_scaled_mm with rowwise scales = dequantize both operands, then matmul; scales in the
    other convention (amax-to-448 multipliers, as some libraries keep them) are far off."""
    xq, sx = quantize_rows(spread_rows(24, 64, seed=1))
    wq, sw = quantize_rows(spread_rows(48, 64, seed=2))
    y = fp8_matmul(xq, sx, wq, sw.t().contiguous())
    assert y.dtype == torch.bfloat16 and y.shape == (24, 48)
    emulated = dequantize_rows(xq, sx) @ dequantize_rows(wq, sw).t()
    assert rel(y, emulated) < 5e-3                                   # bf16 output rounding
    inverse = fp8_matmul(xq, 1 / sx, wq, 1 / sw.t().contiguous())      # the other convention
    assert rel(inverse, emulated) > 0.5


def test_fp8_linear_close_to_linear() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(128, 64)
    with torch.no_grad():
        linear.weight.copy_(spread_rows(64, 128, seed=3) * 0.01)
    x = torch.randn(3, 5, 128) * torch.logspace(-1, 1, 5)[:, None]    # tokens of every size
    ref = linear(x)
    fp8 = Fp8Linear.from_linear(linear)
    y = fp8(x)
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert rel(y, ref) < 0.04
    fp8.weight_scale = fp8.weight_scale.flip(-1)                      # scales of other rows
    assert rel(fp8(x), ref) > 0.5


def _tiny_qwen_image() -> QwenImageTransformer2DModel:
    return QwenImageTransformer2DModel(QwenImageTransformerConfig(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4)))


def _tiny_flux() -> FluxTransformer2DModel:
    return FluxTransformer2DModel(FluxTransformerConfig(
        in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
        axes_dims_rope=(4, 6, 6)))


def _tiny_z_image() -> ZImageTransformer2DModel:
    return ZImageTransformer2DModel(ZImageConfig(
        dim=48, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16,
        axes_dims=(8, 8, 8), axes_lens=(64, 32, 32)))         # feed-forward 48 -> 128


def _tiny_sd3() -> SD3Transformer2DModel:
    return SD3Transformer2DModel(SD3TransformerConfig(
        in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=32, pooled_projection_dim=16,
        pos_embed_max_size=8, dual_attention_layers=(0,), qk_norm="rms_norm"))


def _tiny_wan() -> WanTransformer3DModel:
    return WanTransformer3DModel(WanTransformerConfig(
        num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
        text_dim=16, freq_dim=16, ffn_dim=64, num_layers=1))


def _randomize(model: nn.Module, seed: int) -> nn.Module:
    """Weights ~ N(0, 0.1), norm scales near 1 (the constructors leave them uninitialised)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1 + noise if "norm" in name and p.dim() == 1 else noise)
    return model.eval()


# (model, linears it keeps unquantized, linears of its blocks that must be quantized)
POLICIES = {
    "qwen-image": (_tiny_qwen_image, {"img_in", "txt_in", "proj_out", "norm_out.linear",
                                      "time_text_embed.timestep_embedder.linear_1",
                                      "transformer_blocks.0.img_mod.1",
                                      "transformer_blocks.1.txt_mod.1"},
                   {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_add_out",
                    "transformer_blocks.1.img_mlp.net.0.proj", "transformer_blocks.1.txt_mlp.net.2"}),
    "flux": (_tiny_flux, {"x_embedder", "context_embedder", "proj_out", "norm_out.linear",
                          "transformer_blocks.0.norm1.linear",
                          "transformer_blocks.0.norm1_context.linear",
                          "single_transformer_blocks.0.norm.linear"},
             {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.ff.net.2",
              "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.proj_out"}),
    "z-image": (_tiny_z_image, {"all_x_embedder.2-1", "cap_embedder.1", "t_embedder.mlp.0",
                                "layers.0.adaLN_modulation.0", "all_final_layer.2-1.linear",
                                "all_final_layer.2-1.adaLN_modulation.1"},
                {"layers.0.attention.to_q", "layers.0.feed_forward.w2",
                 "context_refiner.0.attention.to_out.0"}),
    "sd3": (_tiny_sd3, {"context_embedder", "proj_out", "norm_out.linear",
                        "time_text_embed.text_embedder.linear_1",
                        "transformer_blocks.0.norm1.linear",
                        "transformer_blocks.1.norm1_context.linear"},
            {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn2.to_out.0",
             "transformer_blocks.0.attn.to_add_out", "transformer_blocks.1.ff.net.2",
             "transformer_blocks.0.ff_context.net.0.proj"}),
    "wan": (_tiny_wan, {"proj_out", "condition_embedder.time_proj",
                        "condition_embedder.text_embedder.linear_1"},
            {"blocks.0.attn1.to_q", "blocks.0.attn2.to_k", "blocks.0.ffn.net.2"}),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_keeps_named_layers(name: str) -> None:
    build, kept, quantized = POLICIES[name]
    model = build()
    swapped = quantize_fp8(model, min_features=16, allow_cpu=True)
    modules = dict(model.named_modules())
    for layer in kept:
        assert not isinstance(modules[layer], Fp8Linear), layer
    for layer in quantized:
        assert isinstance(modules[layer], Fp8Linear) and layer in swapped, layer
    assert not any(isinstance(m, Fp8Linear) for m in build().modules())
    assert quantize_fp8(build(), allow_cpu=True) == []      # every tiny linear under 1024


def test_refusals() -> None:
    with pytest.raises(ValueError, match="runs on CUDA GPUs of compute capability 8.9"):
        quantize_fp8(_tiny_qwen_image(), min_features=16)           # the CPU, no allow_cpu
    with pytest.raises(ValueError, match="has no FP8 policy"):
        quantize_fp8(nn.Sequential(nn.Linear(32, 32)), allow_cpu=True)
    check_fp8_device(torch.device("cpu"), allow_cpu=True)


def test_weight_bytes_halve() -> None:
    """Quantized layers keep 1 byte per weight and 4 per output channel: half of bf16, and
    the bf16 weights are gone from the model."""
    class Stack(nn.Sequential):
        fp8_keep = ("0",)                               # one layer kept: it keeps its bytes

    def nbytes(m: nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))

    model = Stack(*(nn.Linear(256, 256, bias=False) for _ in range(5))).to(torch.bfloat16)
    before = nbytes(model)
    assert quantize_fp8(model, min_features=16, allow_cpu=True) == ["1", "2", "3", "4"]
    kept = 256 * 256 * 2
    assert nbytes(model) - kept == pytest.approx((before - kept) * (0.5 + 2 / 256))
    assert all(p.dtype != torch.bfloat16 or p.shape == (256, 256)
               for p in model[1:].parameters()) and not list(model[1:].parameters())


def _denoise(forward, x: Tensor, steps: int = 4) -> Tensor:
    """A plain Euler flow-match loop from t=1 to 0."""
    ts = torch.linspace(1.0, 0.0, steps + 1)
    for t, t_next in itertools.pairwise(ts):
        x = x + (t_next - t) * forward(x, t.expand(x.shape[0]))
    return x


def _psnr(x: Tensor, ref: Tensor) -> float:
    mse = float((x - ref).pow(2).mean())
    return 10 * math.log10(float(ref.max() - ref.min()) ** 2 / mse)


def _qwen_image_run(model: nn.Module, latents: Tensor, text: Tensor) -> Tensor:
    return _denoise(lambda x, t: model(x, text, None, t, img_shapes=[[(1, 4, 4)]]), latents)


def _flux_run(model: nn.Module, latents: Tensor, text: Tensor) -> Tensor:
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                         indexing="ij"), -1).reshape(-1, 3)
    txt_ids, pooled = torch.zeros(text.shape[1], 3), text[:, 0]
    return _denoise(lambda x, t: model(x, text, pooled, t, img_ids, txt_ids), latents)


@pytest.mark.parametrize("name, run", [("qwen-image", _qwen_image_run), ("flux", _flux_run)])
def test_fp8_latents_close_to_float(name: str, run) -> None:
    """The same 4-step denoising with FP8 blocks: latents within 30 dB of float32's (and not
    equal: the FP8 path did run)."""
    model = _randomize(POLICIES[name][0](), seed=0)
    gen = torch.Generator().manual_seed(1)
    latents, text = torch.randn(1, 16, 16, generator=gen), torch.randn(1, 8, 16, generator=gen)
    with torch.inference_mode():
        ref = run(model, latents, text)
        assert len(quantize_fp8(model, min_features=16, allow_cpu=True)) > 4
        fp8 = run(model, latents, text)
    assert 30 < _psnr(fp8, ref) < 80, _psnr(fp8, ref)
