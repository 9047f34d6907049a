"""Our Flux2Transformer2DModel against diffusers' on a tiny random checkpoint: same outputs in
float32 (klein without guidance embeds, dev with them; reference-image tokens with their own
position ids), step caching that runs every step equals no caching, and loading that fails by
name on a mis-shaped tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from omnistage.layers.step_cache import CacheGroup, StepCacheState
from omnistage.models.flux2_transformer import Flux2Transformer2DModel

diffusers = pytest.importorskip("diffusers")

TINY = dict(in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=[4, 4, 4, 4])
B, N_TXT, H, W, N_REF = 2, 5, 3, 4, 6


def save_reference(path: Path, guidance_embeds: bool) -> diffusers.Flux2Transformer2DModel:
    torch.manual_seed(0)
    ref = diffusers.Flux2Transformer2DModel(**TINY, guidance_embeds=guidance_embeds).eval()
    with torch.no_grad():
        for p in ref.parameters():   # make every path count, at a meaningful scale
            p.normal_(0.0, 0.1)
    ref.save_pretrained(path)
    return ref


def inputs(guidance: bool) -> dict[str, Tensor | None]:
    g = torch.Generator().manual_seed(1)
    t, h, w, l = torch.arange(1), torch.arange(H), torch.arange(W), torch.arange(1)
    img_ids = torch.cartesian_prod(t, h, w, l)                        # (H*W, 4): (0, row, col, 0)
    ref_ids = torch.cartesian_prod(torch.tensor([10]), torch.arange(2), torch.arange(3), l)
    return dict(
        hidden_states=torch.randn(B, H * W + N_REF, TINY["in_channels"], generator=g),
        encoder_hidden_states=torch.randn(B, N_TXT, TINY["joint_attention_dim"], generator=g),
        timestep=torch.tensor([0.9, 0.35]),                            # pipeline passes t / 1000
        img_ids=torch.cat([img_ids, ref_ids]),
        txt_ids=torch.cartesian_prod(t, torch.arange(1), torch.arange(1), torch.arange(N_TXT)),
        guidance=torch.tensor([4.0, 2.5]) if guidance else None,
    )


@pytest.mark.parametrize("guidance_embeds", [False, True], ids=["klein", "dev"])
def test_matches_diffusers(tmp_path: Path, guidance_embeds: bool) -> None:
    ref = save_reference(tmp_path, guidance_embeds)
    ours = Flux2Transformer2DModel.from_pretrained(tmp_path, "cpu", torch.float32)
    x = inputs(guidance_embeds)
    with torch.no_grad():
        expected = ref(**x, return_dict=False)[0]
        got = ours(**x)
    assert got.shape == (B, H * W + N_REF, TINY["in_channels"])
    assert expected.abs().mean() > 0.1                                 # a meaningful scale
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_step_cache_that_runs_equals_no_cache(tmp_path: Path) -> None:
    save_reference(tmp_path, False)
    ours = Flux2Transformer2DModel.from_pretrained(tmp_path, "cpu", torch.float32)
    x = inputs(False)
    groups = [CacheGroup(slice(i, i + 1), StepCacheState(), 0.0, True, None) for i in range(B)]
    with torch.no_grad():
        torch.testing.assert_close(ours(**x, step_cache=groups), ours(**x))


def test_misshaped_tensor_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path, False)
    file = tmp_path / "diffusion_pytorch_model.safetensors"
    tensors = load_file(file)
    tensors["x_embedder.weight"] = tensors["x_embedder.weight"][:, :-1].contiguous()
    save_file(tensors, file)
    with pytest.raises(ValueError, match="x_embedder.weight"):
        Flux2Transformer2DModel.from_pretrained(tmp_path, "cpu", torch.float32)
