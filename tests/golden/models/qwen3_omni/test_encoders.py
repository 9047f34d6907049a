"""Our Qwen3-Omni audio and vision encoders against transformers' on the tiny random
checkpoint: same outputs in float32 (two audios of different lengths in one call, two images of
different sizes plus a two-frame video, deepstack features included), and strict loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.models.qwen3_omni.audio_encoder import (AudioEncoder, output_lengths,
                                                        varlen_attention)
from omnistage.models.qwen3_omni.vision_encoder import VisionEncoder
from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

ATOL = 1e-4


def build_checkpoint(path: Path) -> Path:
    """The tiny checkpoint with the released audio windows (n_window=50): HF hardcodes 13
    tokens per 100-frame chunk, so the tiny n_window=4 cannot run through HF's encoder. The
    weights do not depend on n_window. n_window_infer=200 makes 2-chunk attention windows."""
    build_tiny_qwen3_omni(path)
    config = json.loads((path / "config.json").read_text())
    config["thinker_config"]["audio_config"].update(n_window=50, n_window_infer=200)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def omni_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("omni"))


@pytest.fixture(scope="module")
def hf_thinker(omni_path: Path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(omni_path, dtype=torch.float32)
    return model.thinker.eval()


def test_audio_matches_hf(omni_path: Path, hf_thinker) -> None:
    ours = AudioEncoder.from_pretrained(omni_path)
    # 437 frames: 4 full chunks (52 tokens, windows of 26) + 37; 60 frames: a lone tail chunk
    lens = torch.tensor([437, 60, 200])
    feats = torch.randn(128, int(lens.sum()), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_thinker.model.audio_tower(feats, feature_lens=lens).last_hidden_state
        got = ours(feats, lens)
    assert got.shape == (int(output_lengths(lens).sum()), 64) == ref.shape
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    # one audio alone (the longest chunk is then its own tail, as in HF)
    with torch.no_grad():
        ref1 = hf_thinker.model.audio_tower(feats[:, 437:497], feature_lens=lens[1:2])
        got1 = ours(feats[:, 437:497].contiguous(), lens[1:2])
    torch.testing.assert_close(got1, ref1.last_hidden_state, atol=ATOL, rtol=0)


def test_audio_output_lengths_match_hf() -> None:
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths)

    lens = torch.arange(1, 3001)
    assert torch.equal(output_lengths(lens, 50), _get_feat_extract_output_lengths(lens, 50))


def test_audio_rejects_bad_lengths(omni_path: Path) -> None:
    ours = AudioEncoder.from_pretrained(omni_path)
    with pytest.raises(ValueError, match="feature_lens"):
        ours(torch.randn(128, 10), torch.tensor([6, 5]))
    with pytest.raises(ValueError, match="feature_lens"):
        ours(torch.randn(128, 10), torch.tensor([10, 0]))
    with pytest.raises(ValueError, match="input_features"):
        ours(torch.randn(80, 10), torch.tensor([10]))


def pixel_inputs(grids: list[list[int]], patch_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    grid_thw = torch.tensor(grids)
    n = int(grid_thw.prod(-1).sum())
    return torch.randn(n, patch_dim, generator=torch.Generator().manual_seed(1)), grid_thw


def test_vision_matches_hf(omni_path: Path, hf_thinker) -> None:
    ours = VisionEncoder.from_pretrained(omni_path)
    # two images of different sizes (one smaller, one larger than the 8x8 position table) and
    # a two-frame video
    pixels, grid_thw = pixel_inputs([[1, 6, 8], [1, 12, 10], [2, 4, 6]], 3 * 2 * 4 * 4)
    with torch.no_grad():
        ref = hf_thinker.model.visual(pixels, grid_thw=grid_thw)
        embeds, deepstack = ours(pixels, grid_thw)
    assert embeds.shape == (sum(ours.num_tokens(grid_thw)), 64)
    torch.testing.assert_close(embeds, ref.pooler_output, atol=ATOL, rtol=0)
    assert len(deepstack) == len(ref.deepstack_features) == 2
    for got, want in zip(deepstack, ref.deepstack_features):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_vision_rejects_mismatched_pixels(omni_path: Path) -> None:
    ours = VisionEncoder.from_pretrained(omni_path)
    pixels, grid_thw = pixel_inputs([[1, 4, 4]], 96)
    with pytest.raises(ValueError, match="pixel_values"):
        ours(pixels[:-1], grid_thw)
    with pytest.raises(ValueError, match="grid_thw"):
        ours(pixels[:12], torch.tensor([[1, 3, 4]]))


def test_varlen_attention_is_per_segment() -> None:
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(9, 2, 8, generator=g) for _ in range(3))
    out = varlen_attention(q, k, v, [0, 4, 5, 9], 0.3)
    for a, b in ((0, 4), (4, 5), (5, 9)):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), scale=0.3)
        torch.testing.assert_close(out[a:b], ref.transpose(0, 1))


def test_sharded_checkpoint_loads_only_its_prefix(omni_path: Path, tmp_path: Path) -> None:
    """Shards with an index: the audio tower is read from its shard alone and equals the
    single-file load."""
    tensors = load_file(omni_path / "model.safetensors")
    audio = {k: v for k, v in tensors.items() if k.startswith("thinker.audio_tower.")}
    rest = {k: v for k, v in tensors.items() if k not in audio}
    for name in ("config.json",):
        shutil.copy(omni_path / name, tmp_path / name)
    save_file(audio, tmp_path / "model-00001-of-00002.safetensors")
    save_file(rest, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in audio}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in rest}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = AudioEncoder.from_pretrained(tmp_path)
    single = AudioEncoder.from_pretrained(omni_path)
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items()):
        assert torch.equal(a, b), name
    # the vision tower lives in the second shard only
    vision = VisionEncoder.from_pretrained(tmp_path)
    assert torch.equal(vision.pos_embed.weight, tensors["thinker.visual.pos_embed.weight"])


@pytest.mark.parametrize("change", ["missing", "unexpected", "shape"])
def test_strict_loading(omni_path: Path, tmp_path: Path, change: str) -> None:
    tensors = load_file(omni_path / "model.safetensors")
    if change == "missing":
        del tensors["thinker.visual.blocks.1.attn.qkv.bias"]
        match = "missing tensors: thinker.visual.blocks.1.attn.qkv.bias"
    elif change == "unexpected":
        tensors["thinker.visual.blocks.9.attn.qkv.bias"] = torch.zeros(96)
        match = "unexpected tensors .*thinker.visual.blocks.9.attn.qkv.bias"
    else:
        tensors["thinker.visual.pos_embed.weight"] = torch.zeros(49, 32)
        match = "thinker.visual.pos_embed.weight.*expected shape \\(64, 32\\), got \\(49, 32\\)"
    shutil.copy(omni_path / "config.json", tmp_path / "config.json")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=match):
        VisionEncoder.from_pretrained(tmp_path)


def test_bfloat16_load_runs(omni_path: Path) -> None:
    ours = VisionEncoder.from_pretrained(omni_path, dtype=torch.bfloat16)
    pixels, grid_thw = pixel_inputs([[1, 4, 4]], 96)
    embeds, deepstack = ours(pixels, grid_thw)
    assert embeds.dtype == torch.bfloat16 and embeds.shape == (4, 64)
    assert all(d.dtype == torch.bfloat16 for d in deepstack)
