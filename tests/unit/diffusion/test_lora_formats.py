"""LoRA files read into (A, B, scaling) per module, no model run: kohya's fused FLUX.1
projections split by the model's own sizes (a single block's linear1 = q | k | v | mlp, which
diffusers' converter only knows at FLUX.1's full size), alpha / r, PEFT metadata, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from omnistage.diffusion.lora import LoraAdapters
from omnistage.diffusion.lora_formats import read_adapter
from omnistage.diffusion_params import LoraRequest
from omnistage.errors import InputError


class Single(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.to_q, self.attn.to_k, self.attn.to_v = (nn.Linear(8, 8) for _ in range(3))
        self.proj_mlp = nn.Linear(8, 24)
        self.proj_out = nn.Linear(32, 8)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.single_transformer_blocks = nn.ModuleList([Single()])


def test_kohya_linear1_split_by_the_model_sizes(tmp_path: Path) -> None:
    down, up = torch.randn(4, 8), torch.randn(48, 4)
    save_file({"lora_unet_single_blocks_0_linear1.lora_down.weight": down,
               "lora_unet_single_blocks_0_linear1.lora_up.weight": up,
               "lora_unet_single_blocks_0_linear1.alpha": torch.tensor(2.0)},
              str(tmp_path / "k.safetensors"))
    layers = read_adapter(tmp_path / "k.safetensors", Tiny())
    names = [f"single_transformer_blocks.0.{n}" for n in
             ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")]
    assert list(layers) == names
    for layer, rows in zip(layers.values(), up.split([8, 8, 8, 24])):
        assert torch.equal(layer.a, down) and torch.equal(layer.b, rows)
        assert layer.scaling == 0.5                                    # alpha / r


def test_peft_metadata_scaling_and_refusals(tmp_path: Path) -> None:
    key = "transformer.single_transformer_blocks.0.proj_out"
    good = {f"{key}.lora_A.weight": torch.randn(2, 32), f"{key}.lora_B.weight": torch.randn(8, 2)}
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": 2,
                                                 "transformer.lora_alpha": 6})}
    save_file(good, str(tmp_path / "p.safetensors"), metadata=meta)
    (layer,) = read_adapter(tmp_path / "p.safetensors", Tiny()).values()
    assert layer.scaling == 3.0
    bad = {"text_encoder.x.lora_A.weight": torch.ones(1, 1)}, {
        f"{key}.lora_A.weight": torch.ones(2, 31), f"{key}.lora_B.weight": torch.ones(8, 2)}, {
        "transformer.nope.lora_A.weight": torch.ones(2, 8),
        "transformer.nope.lora_B.weight": torch.ones(8, 2)}, {
        f"{key}.lora_A.weight": torch.ones(2, 32)}
    for i, tensors in enumerate(bad):
        save_file(tensors, str(tmp_path / f"b{i}.safetensors"))
        with pytest.raises(ValueError):
            read_adapter(tmp_path / f"b{i}.safetensors", Tiny())


def test_applied_adds_the_update_and_leaves_the_base(tmp_path: Path) -> None:
    model = Tiny()
    key = "transformer.single_transformer_blocks.0.proj_out"
    a, b = torch.randn(2, 32), torch.randn(8, 2)
    save_file({f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b},
              str(tmp_path / "p.safetensors"))
    adapters = LoraAdapters(model, max_loras=1)
    adapters.ensure(LoraRequest("p", str(tmp_path / "p.safetensors")))
    linear = model.single_transformer_blocks[0].proj_out
    x = torch.randn(3, 32)
    with torch.no_grad():
        base = linear(x)
        with adapters.applied("p", 0.5):
            torch.testing.assert_close(linear(x), base + 0.5 * x @ a.T @ b.T)
        torch.testing.assert_close(linear(x), base)                 # hooks taken off
    adapters.ensure(LoraRequest("q", str(tmp_path / "p.safetensors")))
    assert adapters.names == ["q"]                                  # max_loras 1: p evicted
    with pytest.raises(InputError) as err:
        adapters.ensure(LoraRequest("p"))
    assert err.value.param == "lora.name"
