"""Qwen2.5-Omni's media inputs against transformers on the tiny random checkpoint, float32:
the audio and vision encoders' outputs, the processor's audio features and token counts, and
its TMRoPE positions against `get_rope_index` (audio, an image and a video at a frame rate
whose time step is fractional)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.models.qwen2_5_omni.audio_encoder import Qwen2_5OmniAudioEncoder, output_lengths
from omnistage.models.qwen2_5_omni.processing import Qwen2_5OmniInputProcessor
from omnistage.models.qwen2_5_omni.vision_encoder import Qwen2_5OmniVisionEncoder, fuse_qkv

ATOL = 1e-5


@pytest.fixture(scope="module")
def processor(omni25_path: Path) -> Qwen2_5OmniInputProcessor:
    return Qwen2_5OmniInputProcessor.from_pretrained(omni25_path)


def media_chat(seed: int = 0) -> list[dict]:
    """A user turn with one audio (1.3 s), one image and a 5-frame video at 3 fps (2/3 s a
    temporal patch: 16.67 positions, rounded down per patch by the reference)."""
    rng = np.random.default_rng(seed)
    wave = (0.3 * np.sin(np.arange(20800) / 16000 * 2 * np.pi * 440)
            + 0.05 * rng.standard_normal(20800)).astype(np.float32)
    image = Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8))
    frames = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
              for _ in range(5)]
    return [{"role": "user", "content": [
        {"type": "audio", "audio": (wave, 16000)}, {"type": "image", "image": image},
        {"type": "video", "video": frames, "fps": 3.0}, {"type": "text", "text": "What?"}]}]


def test_audio_encoder_matches_hf(omni25_path: Path, omni25_hf) -> None:
    ours = Qwen2_5OmniAudioEncoder.from_pretrained(omni25_path)
    # 250 frames: chunks of 100, 100, 50 (attention per chunk); 37: one odd tail (pooling
    # drops its last frame)
    lens = torch.tensor([250, 37])
    feats = torch.randn(128, int(lens.sum()), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = omni25_hf.thinker.model.audio_tower(feats, feature_lens=lens).last_hidden_state
        got = ours(feats, lens)
    assert got.shape == (int(output_lengths(lens).sum()), 64) == ref.shape
    assert ref.std() > 0.05
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_vision_encoder_matches_hf(omni25_path: Path, omni25_hf) -> None:
    ours = Qwen2_5OmniVisionEncoder.from_pretrained(omni25_path)
    grid = torch.tensor([[1, 8, 12], [2, 4, 4]])     # an image (2x3 windows) and a video
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4,
                         generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = omni25_hf.thinker.model.visual(pixels, grid_thw=grid).pooler_output
        got = ours(pixels, grid)
    assert got.shape == ref.shape == (32, 64) and ref.std() > 0.05
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_fuse_qkv_refuses_a_lone_piece() -> None:
    tensors = [("blocks.0.attn.q.weight", torch.zeros(2, 2)),
               ("blocks.0.attn.k.weight", torch.zeros(2, 2))]
    with pytest.raises(ValueError, match=r"blocks.0.attn.\{q,k\}.weight"):
        list(fuse_qkv(iter(tensors)))


def test_processor_matches_hf(processor: Qwen2_5OmniInputProcessor, omni25_hf) -> None:
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
        _get_feat_extract_output_lengths)

    chat = media_chat()
    inputs = processor(chat)
    wave = chat[0]["content"][0]["audio"][0]
    ref = processor.feature_extractor([wave], sampling_rate=16000, padding="max_length",
                                      return_attention_mask=True, return_tensors="pt")
    num_frames = int(ref["attention_mask"].sum())
    torch.testing.assert_close(inputs.input_features, ref["input_features"][0, :, :num_frames])
    counts = {t: int((inputs.input_ids == t).sum()) for t in
              (processor.tokens.audio_pad, processor.tokens.image_pad, processor.tokens.video_pad)}
    assert counts[processor.tokens.audio_pad] == int(
        _get_feat_extract_output_lengths(torch.tensor(num_frames)))
    assert counts[processor.tokens.image_pad] == int(inputs.image_grid_thw.prod() // 4)
    kw = inputs.hf_kwargs()
    positions, delta = omni25_hf.thinker.model.get_rope_index(
        kw["input_ids"], kw["image_grid_thw"], kw["video_grid_thw"], kw["attention_mask"],
        False, kw["feature_attention_mask"].sum(-1), kw["video_second_per_grid"])
    assert torch.equal(inputs.positions, positions[:, 0])
    assert inputs.rope_delta == int(delta) < 0
    assert inputs.positions[0].tolist() != inputs.positions[1].tolist()   # 3-D, not 1-D


def test_processor_refuses_bad_media(processor: Qwen2_5OmniInputProcessor) -> None:
    def user(part: dict) -> list[dict]:
        return [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}]

    with pytest.raises(ValueError, match="cannot decode"):
        processor(user({"type": "audio", "audio": b"not a wav file"}))
    with pytest.raises(ValueError, match="too short"):
        processor(user({"type": "audio", "audio": (np.zeros(10, np.float32), 16000)}))
    with pytest.raises(ValueError, match="same size"):
        processor(user({"type": "video", "video": [Image.new("RGB", (32, 32)),
                                                   Image.new("RGB", (16, 32))]}))
    with pytest.raises(ValueError, match=r"content\[0\].use_audio_in_video: give the video's"):
        processor(user({"type": "video", "video": [Image.new("RGB", (32, 32))],
                        "use_audio_in_video": True}))
    with pytest.raises(ValueError, match="placeholders"):
        processor.process("<|audio_start|><|audio_pad|><|audio_end|>")
