"""Our QwenImageTransformer2DModel against diffusers' on a tiny random checkpoint: same outputs
in float32 (text mask with different lengths, no mask, Edit-2511's zero_cond_t with a condition
image, additional t cond; single-file and sharded folders), the same rope tables, and loading
that fails by name on missing, unexpected or mis-shaped tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import Tensor

from omnistage.models.qwen_image_transformer import QwenImageTransformer2DModel, qwen_rope
from omnistage.testing.tiny_models import edit_checkpoint

diffusers = pytest.importorskip("diffusers")

TINY = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=[8, 4, 4])
B, N_TXT, H, W = 2, 5, 3, 4     # odd H: rope's centred rows are asymmetric


def save_reference(path: Path, max_shard_size: str | None = None, **extra: bool
                   ) -> diffusers.QwenImageTransformer2DModel:
    torch.manual_seed(0)
    ref = diffusers.QwenImageTransformer2DModel(**TINY, **extra).eval()
    with torch.no_grad():
        for p in ref.parameters():   # diffusers zero-inits some layers: make every path count
            p.normal_(0.0, 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    ref.save_pretrained(path, **kwargs)
    return ref


def inputs(mask: str, num_images: int = 1) -> dict[str, Tensor | list | None]:
    g = torch.Generator().manual_seed(1)
    shapes = [(1, H, W), (1, 2, 2)][:num_images]           # target, then a condition image
    num_img = sum(f * h * w for f, h, w in shapes)
    text_mask = {"none": None,
                 "padded": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
                 "holes": torch.tensor([[1, 0, 1, 1, 0], [0, 1, 1, 0, 0]], dtype=torch.bool)}[mask]
    return dict(
        hidden_states=torch.randn(B, num_img, TINY["in_channels"], generator=g),
        encoder_hidden_states=torch.randn(B, N_TXT, TINY["joint_attention_dim"], generator=g),
        encoder_hidden_states_mask=text_mask,
        timestep=torch.tensor([0.9, 0.35]),                  # pipeline passes t / 1000
        img_shapes=[list(shapes)] * B,
    )


def check(ref: torch.nn.Module, path: Path, **x) -> None:
    ours = QwenImageTransformer2DModel.from_pretrained(path, "cpu", torch.float32)
    with torch.no_grad():
        expected = ref(**x, return_dict=False)[0]
        got = ours(**x)
    assert got.shape == (B, x["hidden_states"].shape[1], TINY["patch_size"] ** 2 * 4)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mask", ["padded", "holes", "none"])
def test_matches_diffusers(tmp_path: Path, mask: str) -> None:
    check(save_reference(tmp_path), tmp_path, **inputs(mask))


def test_sharded_folder_matches_diffusers(tmp_path: Path) -> None:
    ref = save_reference(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    check(ref, tmp_path, **inputs("padded"))


def test_zero_cond_t_with_condition_image_matches_diffusers(tmp_path: Path) -> None:
    check(save_reference(tmp_path, zero_cond_t=True), tmp_path, **inputs("padded", num_images=2))


def test_additional_t_cond_matches_diffusers(tmp_path: Path) -> None:
    ref = save_reference(tmp_path, use_additional_t_cond=True)
    check(ref, tmp_path, **inputs("padded"), additional_t_cond=torch.tensor([0, 1]))


@pytest.mark.parametrize("shapes", [[(1, 3, 4)], [(1, 5, 2), (1, 2, 3)], [(2, 4, 4)]])
def test_rope_matches_diffusers(shapes: list[tuple[int, int, int]]) -> None:
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope
    img, txt = qwen_rope([shapes], 7, (8, 4, 4), torch.device("cpu"))
    ref_img, ref_txt = QwenEmbedRope(10000, [8, 4, 4], scale_rope=True)(
        [shapes], max_txt_seq_len=7, device=torch.device("cpu"))
    assert torch.equal(img, ref_img) and torch.equal(txt, ref_txt)


def test_misshaped_tensor_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path)
    name = "transformer_blocks.1.img_mlp.net.2.weight"
    edit_checkpoint(tmp_path, lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    with pytest.raises(ValueError, match=rf"'{name}': expected shape \(32, 128\), got \(32, 127\)"):
        QwenImageTransformer2DModel.from_pretrained(tmp_path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path)
    name = "transformer_blocks.0.attn.norm_added_k.weight"
    edit_checkpoint(tmp_path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing tensors: {name}"):
        QwenImageTransformer2DModel.from_pretrained(tmp_path)


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path, use_additional_t_cond=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_additional_t_cond": False}))
    with pytest.raises(ValueError, match=r"unexpected tensors .*addition_t_embedding\.weight"):
        QwenImageTransformer2DModel.from_pretrained(tmp_path)


def test_unknown_config_key_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_layer": 3}))
    with pytest.raises(ValueError, match=r"unknown keys \['num_layer'\]"):
        QwenImageTransformer2DModel.from_pretrained(tmp_path)
