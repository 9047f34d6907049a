"""`omnistage bench diffusion --model flux1-dev | z-image-turbo` (diffusion_variants.py)
on tiny shapes on the CPU, without compilation (its compile runs on the device): every
variant runs in the same loop from the same weights, ours equals diffusers in float32, FP8
lands near our float32, each profile accounts for its kernels by kind."""

from __future__ import annotations

import pytest

from omnistage.benchmarks import diffusion_variants as dv
from omnistage.benchmarks.kernel_profile import kind_of

pytest.importorskip("diffusers")


@pytest.mark.parametrize("model", ["z-image-turbo", "flux1-dev"])   # qwen-image: test_bench
def test_variants_tiny(model: str) -> None:
    result = dv.run(dv.VariantsConfig(model=model, tiny=True, steps=2, compile=False,
                                      device="cpu"))
    runs = result["variants"]
    assert list(runs) == ["diffusers", "ours_unfused", "ours", "ours_fp8"]
    for name in ("ours_unfused", "ours"):              # same weights, same inputs, float32
        assert runs[name]["latents_psnr_db"] > 100, (name, runs[name])
    assert 25 < runs["ours_fp8"]["latents_psnr_db"] < 100          # quantized, yet close
    weights = runs["ours_fp8"]["weights_gib"]
    assert weights["fp8"] < weights["bf16"]
    profile = runs["ours"]["profile"]
    assert profile["total_ms"] > 0 and "matmul" in profile["by_kind_ms"]
    assert result["ratios"]["fp8_latents_psnr_db"] == runs["ours_fp8"]["latents_psnr_db"]
    assert result["ratios"]["exact_speedup_vs_diffusers_compiled"] is None   # not compiled


def test_kernel_kinds() -> None:
    assert kind_of("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") \
        == "attention"
    assert kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "matmul"
    assert kind_of("void cutlass::device_kernel<cutlass::float_e4m3_t, rowwise>") \
        == "fp8 matmul"
    assert kind_of("_quantize_rows_fp8_kernel") == "fp8 quantize"
    assert kind_of("triton_red_fused_abs_amax_clamp_div_0") == "fp8 quantize"
    assert kind_of("_norm_modulate_kernel") == "norm / modulation"
    assert kind_of("_rms_norm_rope_pairs_kernel") == "rotary"
    assert kind_of("_gated_add_kernel") == "gated residual"
    assert kind_of("triton_poi_fused_add_mul_3") == "elementwise, inductor-fused"
    assert kind_of("something else") == "other"
