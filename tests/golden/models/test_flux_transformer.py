"""Our FluxTransformer2DModel against diffusers' on a tiny random checkpoint: same outputs in
float32 (with and without guidance embeds, single-file and sharded folders), and loading that
fails by name on missing, unexpected or mis-shaped tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from omnistage.models.flux_transformer import FluxTransformer2DModel, flux_rope
from omnistage.testing.tiny_models import edit_checkpoint

diffusers = pytest.importorskip("diffusers")

TINY = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8])
B, N_TXT, H, W = 2, 5, 3, 4


def save_reference(path: Path, guidance_embeds: bool, max_shard_size: str | None = None
                   ) -> diffusers.FluxTransformer2DModel:
    torch.manual_seed(0)
    ref = diffusers.FluxTransformer2DModel(**TINY, guidance_embeds=guidance_embeds).eval()
    with torch.no_grad():
        for p in ref.parameters():   # diffusers zero-inits some layers: make every path count
            p.normal_(0.0, 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    ref.save_pretrained(path, **kwargs)
    return ref


def inputs(guidance: bool) -> dict[str, Tensor | None]:
    g = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(H, W, 3)                           # FLUX pipeline: (0, row, col)
    img_ids[..., 1] = torch.arange(H)[:, None]
    img_ids[..., 2] = torch.arange(W)[None, :]
    return dict(
        hidden_states=torch.randn(B, H * W, TINY["in_channels"], generator=g),
        encoder_hidden_states=torch.randn(B, N_TXT, TINY["joint_attention_dim"], generator=g),
        pooled_projections=torch.randn(B, TINY["pooled_projection_dim"], generator=g),
        timestep=torch.tensor([0.9, 0.35]),                  # pipeline passes t / 1000
        img_ids=img_ids.reshape(H * W, 3),
        txt_ids=torch.zeros(N_TXT, 3),
        guidance=torch.tensor([3.5, 3.5]) if guidance else None,
    )


@pytest.mark.parametrize("guidance_embeds", [True, False], ids=["dev", "schnell"])
@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["single", "sharded"])
def test_matches_diffusers(tmp_path: Path, guidance_embeds: bool, max_shard_size: str | None
                           ) -> None:
    ref = save_reference(tmp_path, guidance_embeds, max_shard_size)
    if max_shard_size:
        assert (tmp_path / "diffusion_pytorch_model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = FluxTransformer2DModel.from_pretrained(tmp_path, "cpu", torch.float32)
    x = inputs(guidance_embeds)
    with torch.no_grad():
        expected = ref(**x, return_dict=False)[0]
        got = ours(**x)
    assert got.shape == (B, H * W, TINY["in_channels"])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_rope_matches_diffusers() -> None:
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed
    ids = inputs(False)["img_ids"] + torch.tensor([1.0, 7.0, 3.0])
    cos, sin = flux_rope(ids, (4, 4, 8))
    ref_cos, ref_sin = FluxPosEmbed(10000, [4, 4, 8])(ids)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_default_dtype_is_the_checkpoints(tmp_path: Path) -> None:
    save_reference(tmp_path, False)
    shutil.copytree(tmp_path, tmp_path / "bf16", ignore=shutil.ignore_patterns("bf16"))
    file = tmp_path / "bf16" / "diffusion_pytorch_model.safetensors"
    bf16 = {k: v.bfloat16() for k, v in load_file(file).items()}
    save_file(bf16, file, metadata={"format": "pt"})
    model = FluxTransformer2DModel.from_pretrained(tmp_path / "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path, True)
    name = "transformer_blocks.1.attn.norm_added_k.weight"
    edit_checkpoint(tmp_path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing tensors: {name}"):
        FluxTransformer2DModel.from_pretrained(tmp_path)


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path, True)
    edit_checkpoint(tmp_path, lambda t: t.update({"pos_embed.bogus": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"unexpected tensors .*: pos_embed\.bogus"):
        FluxTransformer2DModel.from_pretrained(tmp_path)


def test_misshaped_tensor_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path, True)
    name = "single_transformer_blocks.0.proj_out.weight"
    edit_checkpoint(tmp_path, lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    with pytest.raises(ValueError, match=rf"'{name}': expected shape \(32, 160\), got \(32, 159\)"):
        FluxTransformer2DModel.from_pretrained(tmp_path)


def test_guidance_checkpoint_without_guidance_embeds_is_not_loaded(tmp_path: Path) -> None:
    """A dev (guidance) checkpoint under a schnell config leaves guidance_embedder unexpected."""
    save_reference(tmp_path, True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "guidance_embeds": False}))
    with pytest.raises(ValueError, match=r"unexpected tensors .*guidance_embedder"):
        FluxTransformer2DModel.from_pretrained(tmp_path)


def test_unknown_config_key_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path, False)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_layer": 3}))
    with pytest.raises(ValueError, match=r"unknown keys \['num_layer'\]"):
        FluxTransformer2DModel.from_pretrained(tmp_path)
