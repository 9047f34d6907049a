"""Our WanTransformer3DModel against diffusers' on tiny random checkpoints, float32: Wan2.1
T2V, Wan2.1 I2V (CLIP image tokens) and FLF2V, Wan2.2 TI2V-5B-like (48 channels, a timestep
per token with the first frame at t = 0, as the pipeline's expand_timesteps); batched rows
with different timesteps equal each row alone; step caching reuses the blocks' residual;
bfloat16 keeps diffusers' float32 parameters; loading fails by name on missing, unexpected or
mis-shaped tensors, and bad inputs by field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import Tensor

from omnistage.layers.step_cache import CacheGroup, StepCacheState
from omnistage.models.wan_transformer import WanTransformer3DModel
from omnistage.testing.tiny_models import edit_checkpoint

diffusers = pytest.importorskip("diffusers")

T2V = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
           out_channels=4, text_dim=16, freq_dim=32, ffn_dim=40, num_layers=2)
I2V = dict(T2V, in_channels=8, image_dim=8, added_kv_proj_dim=24)   # kv dim = heads * hd
TI2V = dict(T2V, in_channels=48, out_channels=48)
B, F, H, W = 2, 3, 6, 4          # latents -> a 3 x 3 x 2 token grid: every rope axis differs
NUM_TOKENS = F * (H // 2) * (W // 2)
TIMESTEPS = torch.tensor([900.0, 350.0])


def save_reference(path: Path, config: dict) -> diffusers.WanTransformer3DModel:
    torch.manual_seed(0)
    ref = diffusers.WanTransformer3DModel(**config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():   # draw every weight: no path starts at zero
            p.normal_(1.0 if ".norm" in name and name.endswith("weight") else 0.0, 0.1)
    ref.save_pretrained(path)
    return ref


def inputs(config: dict, text_len: int = 7, image: bool = False) -> dict[str, Tensor | None]:
    g = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(B, config["in_channels"], F, H, W, generator=g),
        timestep=TIMESTEPS,
        encoder_hidden_states=torch.randn(B, text_len, config["text_dim"], generator=g),
        encoder_hidden_states_image=(torch.randn(B, 5, config["image_dim"], generator=g)
                                     if image else None))


def first_frame_at_zero(t: Tensor) -> Tensor:
    """The Wan2.2 pipelines' expand_timesteps: t per token, 0 on the first latent frame."""
    mask = torch.ones(1, 1, F, H, W)
    mask[:, :, 0] = 0
    return torch.stack([(mask[0][0][:, ::2, ::2] * ti).flatten() for ti in t])   # (B, N)


def check(ref: torch.nn.Module, path: Path, x: dict) -> WanTransformer3DModel:
    """Ours equals diffusers on the batch, and each row alone equals its batched result."""
    ours = WanTransformer3DModel.from_pretrained(path, "cpu", torch.float32)
    with torch.no_grad():
        expected = ref(**x, return_dict=False)[0]
        got = ours(**x)
        assert expected.abs().max() > 0.5, "reference output too small to compare"
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
        for i in range(B):
            row = {k: None if v is None else v[i:i + 1] for k, v in x.items()}
            torch.testing.assert_close(ours(**row), got[i:i + 1], atol=1e-5, rtol=1e-4)
    return ours


def test_t2v_matches_diffusers(tmp_path: Path) -> None:
    check(save_reference(tmp_path, T2V), tmp_path, inputs(T2V))


def test_i2v_with_image_tokens_matches_diffusers(tmp_path: Path) -> None:
    """diffusers splits the image tokens off a 512-token context: captions of 512 here."""
    ref, x = save_reference(tmp_path, I2V), inputs(I2V, text_len=512, image=True)
    ours = check(ref, tmp_path, x)
    with torch.no_grad():   # the image tokens count, far beyond the tolerance
        other = ours(**dict(x, encoder_hidden_states_image=torch.randn(B, 5, 8)))
    assert (other - ours(**x)).abs().max() > 1e-2


def test_flf2v_image_position_table_matches_diffusers(tmp_path: Path) -> None:
    """FLF2V: first and last frame's CLIP tokens, rows in pairs, with a learnt position table."""
    ref = save_reference(tmp_path, dict(I2V, pos_embed_seq_len=10))
    x = dict(inputs(I2V, text_len=512), encoder_hidden_states_image=torch.randn(2 * B, 5, 8))
    ours = WanTransformer3DModel.from_pretrained(tmp_path, "cpu", torch.float32)
    with torch.no_grad():
        expected = ref(**x, return_dict=False)[0]
        torch.testing.assert_close(ours(**x), expected, atol=1e-5, rtol=1e-4)


def test_ti2v_timestep_per_token_matches_diffusers(tmp_path: Path) -> None:
    ref = save_reference(tmp_path, TI2V)
    x = dict(inputs(TI2V), timestep=first_frame_at_zero(TIMESTEPS))
    ours = check(ref, tmp_path, x)
    with torch.no_grad():   # the first frame's t = 0 counts, far beyond the tolerance
        uniform = ours(**dict(x, timestep=TIMESTEPS))
    assert (uniform - ours(**x))[:, :, 0].abs().max() > 1e-2


def test_step_cache_reuses_the_blocks_residual(tmp_path: Path) -> None:
    """A never-skipping cache computes the plain output; with a huge threshold the second,
    identical step skips the blocks and returns the same output from the kept residual."""
    save_reference(tmp_path, T2V)
    ours = WanTransformer3DModel.from_pretrained(tmp_path, "cpu", torch.float32)
    x, states = inputs(T2V), [StepCacheState(), StepCacheState()]

    def groups(threshold: float | None) -> list[CacheGroup]:
        return [CacheGroup(slice(i, i + 1), states[i], threshold, False) for i in range(B)]

    with torch.no_grad():
        plain = ours(**x)
        torch.testing.assert_close(ours(**x, step_cache=groups(None)), plain, atol=0, rtol=0)
        cached = ours(**x, step_cache=groups(1e9))
    assert [s.num_skipped for s in states] == [1, 1]
    torch.testing.assert_close(cached, plain, atol=1e-6, rtol=0)


def test_misshaped_tensor_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path, T2V)
    name = "blocks.1.ffn.net.2.weight"
    edit_checkpoint(tmp_path, lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    with pytest.raises(ValueError, match=rf"'{name}': expected shape \(24, 40\), got \(24, 39\)"):
        WanTransformer3DModel.from_pretrained(tmp_path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path, T2V)
    name = "blocks.0.attn2.norm_k.weight"
    edit_checkpoint(tmp_path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing tensors: {name}"):
        WanTransformer3DModel.from_pretrained(tmp_path)


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path, I2V)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "image_dim": None, "added_kv_proj_dim": None}))
    with pytest.raises(ValueError, match=r"unexpected tensors .*blocks\.0\.attn2\.add_k_proj"):
        WanTransformer3DModel.from_pretrained(tmp_path)


def test_older_saves_unused_image_query_norm_is_skipped(tmp_path: Path) -> None:
    """diffusers ignores `norm_added_q` in older I2V saves; so do we."""
    save_reference(tmp_path, I2V)
    edit_checkpoint(tmp_path, lambda t: t.update({"blocks.0.attn2.norm_added_q.weight":
                                                  torch.ones(24)}))
    WanTransformer3DModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("change, match", [
    (dict(timestep=torch.zeros(B, NUM_TOKENS - 1)), r"timestep must be \(batch,\) or"),
    (dict(hidden_states=torch.zeros(B, 4, F, H - 1, W)), r"multiples of patch_size"),
    (dict(hidden_states=torch.zeros(B, 5, F, H, W)), r"hidden_states must be \(batch, 4,"),
    (dict(encoder_hidden_states_image=torch.zeros(B, 5, 8)), r"encoder_hidden_states_image"),
])
def test_bad_inputs_are_named(tmp_path: Path, change: dict, match: str) -> None:
    save_reference(tmp_path, T2V)
    ours = WanTransformer3DModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):
        ours(**dict(inputs(T2V), **change))


def test_unknown_config_key_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path, T2V)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_layer": 3}))
    with pytest.raises(ValueError, match=r"Wan transformer config: unknown keys \['num_layer'\]"):
        WanTransformer3DModel.from_pretrained(tmp_path)


def test_bfloat16_keeps_diffusers_float32_parameters(tmp_path: Path) -> None:
    """In bfloat16 the parameters diffusers keeps float32 (time embedder, modulation tables,
    norms) stay float32, and the output follows diffusers' model cast the same way."""
    ref = save_reference(tmp_path, TI2V)
    ours = WanTransformer3DModel.from_pretrained(tmp_path, "cpu", torch.bfloat16)
    keep = set(ref._keep_in_fp32_modules)
    fp32 = {n for n, _ in ref.named_parameters() if keep.intersection(n.split("."))}
    assert {"blocks.1.scale_shift_table", "blocks.0.norm2.weight"} <= fp32
    assert fp32 == {n for n, p in ours.named_parameters() if p.dtype == torch.float32}
    with torch.no_grad():   # diffusers' from_pretrained does this only with accelerate
        for name, p in ref.named_parameters():
            if name not in fp32:
                p.data = p.data.bfloat16()
    x = {k: v if k == "timestep" or v is None else v.bfloat16() for k, v in inputs(TI2V).items()}
    with torch.no_grad():
        expected = ref(**x, return_dict=False)[0]
        scale = float(expected.abs().max())
        torch.testing.assert_close(ours(**x), expected, atol=1e-2 * scale, rtol=0)
