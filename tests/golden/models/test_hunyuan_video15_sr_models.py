"""HunyuanVideo-1.5's super-resolution networks on our layers against the upstream code
(Tencent-Hunyuan/HunyuanVideo-1.5 at the commit tests/fixtures/hunyuan_video15_sr/manifest.json
names; scripts/hunyuan_video15_sr_fixtures.py made the fixtures): both latent upsamplers loaded
from the released folder layout, and the SR DiT read from the upstream's own tensor names
(models/hunyuan_video15_original.py) into our HunyuanVideo-1.5 transformer."""

from __future__ import annotations

import json

import pytest
import torch

from omnistage.models.hunyuan_video15_original import (config_from_original,
                                                       load_original_transformer)
from omnistage.models.hunyuan_video15_upsampler import (SRTo720pUpsampler, SRTo1080pUpsampler,
                                                        load_upsampler)
from tests.helpers.hunyuan_video15_sr import build_checkpoint, expected


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("hv15-sr"))


@pytest.mark.parametrize("version, cls", [("720p_sr_distilled", SRTo720pUpsampler),
                                          ("1080p_sr_distilled", SRTo1080pUpsampler)])
def test_upsampler_matches_upstream(root, version: str, cls: type) -> None:
    up = load_upsampler(root / "upsampler" / version)
    assert isinstance(up, cls)
    exp = expected()
    x, want = exp["upsampler.input"], exp[f"upsampler.{version}"]
    assert (want - x).abs().mean() > 0.1          # the network does something
    with torch.no_grad():
        torch.testing.assert_close(up(x), want, atol=1e-5, rtol=1e-5)


def test_sr_transformer_config_translates(root) -> None:
    raw = json.loads((root / "transformer" / "720p_sr_distilled" / "config.json").read_text())
    cfg = config_from_original(raw)
    assert (cfg.in_channels, cfg.out_channels, cfg.num_layers, cfg.target_size) == (98, 32, 2, 960)
    assert cfg.attention_head_dim == 32 and cfg.rope_axes_dim == (8, 12, 12)
    base = dict(raw, concat_condition=True, in_channels=32, ideal_resolution="480p")
    assert config_from_original(base).in_channels == 65         # the base DiT: 2 z + 1
    for bad in (dict(mm_single_blocks_depth=2), dict(attn_mode="flex-block-attn"),
                dict(glyph_byT5_v2=False), dict(some_new_key=1)):
        with pytest.raises(ValueError):
            config_from_original(dict(raw, **bad))


def test_sr_transformer_loads_every_upstream_tensor(root) -> None:
    model = load_original_transformer(root / "transformer" / "720p_sr_distilled")
    assert model.cfg.in_channels == 98
    # the final modulation's halves are swapped (upstream shift|scale, ours scale|shift)
    from safetensors.torch import load_file
    raw = load_file(str(root / "transformer" / "720p_sr_distilled" /
                        "diffusion_pytorch_model.safetensors"))
    shift, scale = raw["final_layer.adaLN_modulation.1.weight"].chunk(2)
    torch.testing.assert_close(model.norm_out.linear.weight, torch.cat([scale, shift]))
    q, k, v = raw["txt_in.individual_token_refiner.blocks.1.self_attn_qkv.weight"].chunk(3)
    refiner = model.context_embedder.token_refiner.refiner_blocks[1].attn
    torch.testing.assert_close(refiner.to_k.weight, k)
    torch.testing.assert_close(refiner.to_v.weight, v)
