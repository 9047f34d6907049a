"""A FLUX.1 GGUF file in BFL's layout (city96's files: double_blocks / single_blocks, stacked
qkv, the final modulation's halves swapped) loaded by ours (models/gguf_layouts.py) and by
diffusers' own converter (`convert_flux_transformer_checkpoint_to_diffusers`, on the file's
tensors as `load_gguf_checkpoint` reads them, dequantized by gguf): the same outputs. The same
for a Wan file in the Wan repository's names (`convert_wan_transformer_to_diffusers`)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from omnistage.layers.gguf import GGUFLinear
from omnistage.models.diffusers_loader import read_config
from omnistage.models.flux_transformer import FluxTransformer2DModel, FluxTransformerConfig
from omnistage.models.gguf_loader import build_from_gguf
from tests.golden.models.test_gguf_loader import TINY, inputs
from tests.helpers.gguf_files import write_bfl_flux_gguf

diffusers = pytest.importorskip("diffusers")
gguf = pytest.importorskip("gguf")
INNER = TINY["attention_head_dim"] * TINY["num_attention_heads"]


def diffusers_converter():
    """diffusers' FLUX.1 converter, its hard-coded inner_dim (3072, FLUX.1's) set to the tiny
    model's: the only change to its code."""
    from diffusers.loaders import single_file_utils as m
    source = inspect.getsource(m.convert_flux_transformer_checkpoint_to_diffusers)
    assert source.count("inner_dim = 3072") == 1
    scope = dict(vars(m))
    exec(source.replace("inner_dim = 3072", f"inner_dim = {INNER}"), scope)
    return scope["convert_flux_transformer_checkpoint_to_diffusers"]


def reference(ref: torch.nn.Module, file: Path) -> torch.nn.Module:
    from diffusers.models.model_loading_utils import load_gguf_checkpoint
    from diffusers.quantizers.gguf.utils import GGUFParameter
    state = {}
    for name, t in load_gguf_checkpoint(str(file), return_tensors=True).items():
        if isinstance(t, GGUFParameter):
            t = torch.from_numpy(gguf.quants.dequantize(t.as_tensor().numpy(), t.quant_type))
        state[name] = t.float()
    assert "double_blocks.0.img_attn.qkv.weight" in state
    ref.load_state_dict(diffusers_converter()(state))
    return ref


def test_bfl_flux_gguf_matches_diffusers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ref = diffusers.FluxTransformer2DModel(**TINY).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.02)
    ref.save_pretrained(tmp_path / "transformer")
    file = tmp_path / "flux-bfl.gguf"
    write_bfl_flux_gguf(ref, file)
    theirs = reference(ref, file)
    config = FluxTransformerConfig.from_dict(read_config(tmp_path / "transformer"))
    ours = build_from_gguf(FluxTransformer2DModel, config, file, "cpu", torch.float32)
    assert sum(isinstance(m, GGUFLinear) for m in ours.modules()) >= 10
    x = inputs()
    with torch.no_grad():
        expected = theirs(**x, return_dict=False)[0]
        got = ours(**x)
    assert expected.abs().mean() > 1e-2
    torch.testing.assert_close(got, expected, atol=1e-5 * expected.abs().max(), rtol=1e-4)


WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
           out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2)


def wan_reference(ref: torch.nn.Module, file: Path) -> torch.nn.Module:
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from diffusers.models.model_loading_utils import load_gguf_checkpoint
    from diffusers.quantizers.gguf.utils import GGUFParameter
    state = {}
    for name, t in load_gguf_checkpoint(str(file), return_tensors=True).items():
        if isinstance(t, GGUFParameter):
            t = torch.from_numpy(gguf.quants.dequantize(t.as_tensor().numpy(), t.quant_type))
        state[name] = t.float()
    assert "blocks.0.self_attn.q.weight" in state and "head.modulation" in state
    ref.load_state_dict(convert_wan_transformer_to_diffusers(state))
    return ref


def test_wan_gguf_matches_diffusers(tmp_path: Path) -> None:
    from omnistage.models.wan_transformer import WanTransformer3DModel
    from omnistage.models.wan_transformer_config import WanTransformerConfig
    from tests.helpers.gguf_files import write_wan_gguf
    torch.manual_seed(0)
    ref = diffusers.WanTransformer3DModel(**WAN).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.normal_(1.0 if ".norm" in name and name.endswith("weight") else 0.0, 0.1)
    ref.save_pretrained(tmp_path / "transformer")
    file = tmp_path / "wan.gguf"
    write_wan_gguf(ref, file)
    theirs = wan_reference(ref, file)
    config = WanTransformerConfig.from_dict(read_config(tmp_path / "transformer"))
    ours = build_from_gguf(WanTransformer3DModel, config, file, "cpu", torch.float32)
    assert sum(isinstance(m, GGUFLinear) for m in ours.modules()) >= 10
    g = torch.Generator().manual_seed(1)
    x = dict(hidden_states=torch.randn(2, 4, 3, 6, 4, generator=g),
             timestep=torch.tensor([900.0, 350.0]),
             encoder_hidden_states=torch.randn(2, 7, 32, generator=g))
    with torch.no_grad():
        expected = theirs(**x, return_dict=False)[0]
        got = ours(**x)
    assert expected.abs().mean() > 1e-2
    torch.testing.assert_close(got, expected, atol=1e-5 * expected.abs().max(), rtol=1e-4)
