"""Golden: our ZImageTransformer2DModel equals diffusers' on the same tiny random weights, in
float32, for batches mixing image sizes and caption lengths; loading is strict by name and shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.models.z_image_transformer import ZImageTransformer2DModel

diffusers = pytest.importorskip("diffusers")

TINY = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2,
            n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True,
            cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0, axes_dims=[4, 6, 6],
            axes_lens=[128, 32, 32])


@pytest.fixture(scope="module")
def reference_and_folder(tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    ref = diffusers.ZImageTransformer2DModel(**TINY).eval()
    with torch.no_grad():
        for p in ref.parameters():        # also the zero-initialised pad tokens
            p.normal_(0.0, 0.1)
    folder = tmp_path_factory.mktemp("z_image") / "transformer"
    ref.save_pretrained(folder, safe_serialization=True)
    return ref, folder


def _inputs(image_hw: list[tuple[int, int]], cap_lens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(4, 1, h, w, generator=g) for h, w in image_hw]
    caps = [torch.randn(n, 16, generator=g) for n in cap_lens]
    t = torch.rand(len(x), generator=g)
    return x, t, caps


@pytest.mark.parametrize("image_hw, cap_lens", [
    ([(8, 8)], [5]),                               # one item: no attention mask
    ([(8, 8), (16, 12)], [7, 40]),                 # padded lengths 32/64 for both streams
    ([(16, 12), (8, 8)], [33, 3]),                 # image longer where caption is shorter
    ([(10, 6), (10, 6)], [32, 32]),                # equal lengths, exact multiple of 32
])
def test_matches_diffusers(reference_and_folder, image_hw, cap_lens) -> None:
    ref, folder = reference_and_folder
    ours = ZImageTransformer2DModel.from_pretrained(folder, device="cpu", dtype=torch.float32)
    x, t, caps = _inputs(image_hw, cap_lens, seed=len(cap_lens) * 100 + cap_lens[0])
    with torch.no_grad():
        expected = ref(x, t, caps, return_dict=False)[0]
        got = ours(x, t, caps, patch_size=2, f_patch_size=1)
    assert len(got) == len(expected) == len(x)
    for g, e, xi in zip(got, expected, x):
        assert g.shape == e.shape == xi.shape
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)


def test_controlnet_residuals_match(reference_and_folder) -> None:
    ref, folder = reference_and_folder
    ours = ZImageTransformer2DModel.from_pretrained(folder, device="cpu", dtype=torch.float32)
    x, t, caps = _inputs([(8, 8), (8, 8)], [7, 7], seed=3)
    hint = {1: torch.randn(2, 32 + 32, 32, generator=torch.Generator().manual_seed(4))}
    with torch.no_grad():
        expected = ref(x, t, caps, controlnet_block_samples=hint, return_dict=False)[0]
        got = ours(x, t, caps, controlnet_block_samples=hint)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)


def test_bfloat16_load_runs(reference_and_folder) -> None:
    _, folder = reference_and_folder
    ours = ZImageTransformer2DModel.from_pretrained(folder, dtype=torch.bfloat16)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    x, t, caps = _inputs([(8, 8)], [5], seed=5)
    with torch.no_grad():
        out = ours([xi.bfloat16() for xi in x], t, [c.bfloat16() for c in caps])
    assert out[0].shape == (4, 1, 8, 8) and torch.isfinite(out[0].float()).all()


def _copy_folder(folder: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "diffusion_pytorch_model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "diffusion_pytorch_model.safetensors")
    return dst


def test_misshaped_tensor_is_named(reference_and_folder, tmp_path: Path) -> None:
    _, folder = reference_and_folder
    name = "layers.1.attention.to_k.weight"
    bad = _copy_folder(folder, tmp_path / "bad",
                       lambda t: t.__setitem__(name, torch.zeros(32, 16)))
    with pytest.raises(ValueError, match=rf"{name}.*expected shape \(32, 32\), got \(32, 16\)"):
        ZImageTransformer2DModel.from_pretrained(bad, dtype=torch.float32)


def test_missing_and_unexpected_tensors_are_named(reference_and_folder, tmp_path: Path) -> None:
    _, folder = reference_and_folder

    def edit(t: dict) -> None:
        t["cap_pad_tokn"] = t.pop("cap_pad_token")
    bad = _copy_folder(folder, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=r"missing tensors: cap_pad_token; unexpected "
                                         r"tensors \(no parameter takes them\): cap_pad_tokn"):
        ZImageTransformer2DModel.from_pretrained(bad, dtype=torch.float32)


def test_sharded_folder_loads(reference_and_folder, tmp_path: Path) -> None:
    ref, folder = reference_and_folder
    ref.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="200KB")
    assert (tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    ours = ZImageTransformer2DModel.from_pretrained(tmp_path / "sharded", dtype=torch.float32)
    ref_state = ref.state_dict()
    for name, p in ours.state_dict().items():
        assert torch.equal(p, ref_state[name]), name


def test_unknown_config_key_fails(reference_and_folder, tmp_path: Path) -> None:
    _, folder = reference_and_folder
    cfg = json.loads((folder / "config.json").read_text()) | {"n_layer": 3}
    dst = _copy_folder(folder, tmp_path / "cfg", lambda t: None)
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="n_layer"):
        ZImageTransformer2DModel.from_pretrained(dst)
