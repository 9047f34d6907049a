"""A tiny FLUX.1 transformer written to GGUF (Q8_0, Q4_K) and loaded by diffusers
(`from_single_file` + GGUFQuantizationConfig, float32) and by ours (models/gguf_loader.py):
the same outputs (the same dequantized weights), weights kept as blocks in ours."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.layers.gguf import GGUFLinear
from omnistage.models.flux_transformer import FluxTransformer2DModel, FluxTransformerConfig
from omnistage.models.diffusers_loader import read_config
from omnistage.models.gguf_loader import build_from_gguf
from tests.helpers.gguf_files import write_gguf

diffusers = pytest.importorskip("diffusers")
gguf = pytest.importorskip("gguf")

TINY = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
            attention_head_dim=128, num_attention_heads=2, joint_attention_dim=256,
            pooled_projection_dim=256, axes_dims_rope=[32, 48, 48], guidance_embeds=True)
B, N_TXT, H, W = 2, 5, 3, 4


def diffusers_gguf_model(ref: torch.nn.Module, file: Path) -> torch.nn.Module:
    """The reference with diffusers' reading of the file (load_gguf_checkpoint), its block
    tensors dequantized in float32 by gguf itself. (diffusers' own torch dequantization,
    quantizers/gguf dequantize_gguf_tensor, multiplies in float16: within float16 rounding of
    it, checked below. `from_single_file` with GGUFQuantizationConfig reads the same tensors but
    needs accelerate, which the test env lacks.)"""
    from diffusers.models.model_loading_utils import load_gguf_checkpoint
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor
    state = load_gguf_checkpoint(str(file), return_tensors=True)
    weights = {}
    for name, t in state.items():
        if isinstance(t, GGUFParameter):
            w = torch.from_numpy(gguf.quants.dequantize(t.as_tensor().numpy(), t.quant_type))
            torch.testing.assert_close(dequantize_gguf_tensor(t).float(), w.float(),
                                       rtol=2e-3, atol=2e-3 * w.abs().max().item())
            t = w
        weights[name] = t.float()
    assert len(weights) > sum(isinstance(t, GGUFParameter) for t in state.values()) >= 10
    ref.load_state_dict(weights)
    return ref


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(H, W, 3)
    img_ids[..., 1] = torch.arange(H)[:, None]
    img_ids[..., 2] = torch.arange(W)[None, :]
    return dict(hidden_states=torch.randn(B, H * W, 16, generator=g),
                encoder_hidden_states=torch.randn(B, N_TXT, 256, generator=g),
                pooled_projections=torch.randn(B, 256, generator=g),
                timestep=torch.tensor([0.9, 0.35]), img_ids=img_ids.reshape(H * W, 3),
                txt_ids=torch.zeros(N_TXT, 3), guidance=torch.tensor([3.5, 2.0]))


@pytest.mark.parametrize("qtype", [8, 12], ids=["Q8_0", "Q4_K"])
def test_flux_gguf_matches_diffusers(tmp_path: Path, qtype: int) -> None:
    torch.manual_seed(0)
    ref = diffusers.FluxTransformer2DModel(**TINY).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.02)
    ref.save_pretrained(tmp_path / "transformer")
    file = tmp_path / "flux.gguf"
    write_gguf(ref, file, qtype)
    theirs = diffusers_gguf_model(ref, file)
    config = FluxTransformerConfig.from_dict(read_config(tmp_path / "transformer"))
    ours = build_from_gguf(FluxTransformer2DModel, config, file, "cpu", torch.float32)
    assert sum(isinstance(m, GGUFLinear) for m in ours.modules()) >= 10
    x = inputs()
    with torch.no_grad():
        expected = theirs(**x, return_dict=False)[0]
        got = ours(**x)
    assert expected.abs().mean() > 1e-2
    torch.testing.assert_close(got, expected, atol=1e-5 * expected.abs().max(), rtol=1e-4)


def test_missing_tensor_named(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ref = diffusers.FluxTransformer2DModel(**TINY).eval()
    ref.proj_out = torch.nn.Identity()
    write_gguf(ref, tmp_path / "flux.gguf", 8)
    config = FluxTransformerConfig(**{k: tuple(v) if isinstance(v, list) else v
                                      for k, v in TINY.items()})
    with pytest.raises(ValueError, match="proj_out"):
        build_from_gguf(FluxTransformer2DModel, config, tmp_path / "flux.gguf", "cpu")
