"""Qwen2.5-Omni's `use_audio_in_video` against transformers on the tiny random checkpoint: a
video part that brings its audio track gives the token ids `Qwen2_5OmniProcessor` makes of the
same prompt (video and audio tokens interleaved by 2 s chunks), and the positions of
`get_rope_index(use_audio_in_video=True)`, next to a standalone audio and an image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.models.qwen2_5_omni.processing import Qwen2_5OmniInputProcessor
from tests.helpers.audio_in_video import frames, hf_processor, tone


@pytest.fixture(scope="module")
def processor(omni25_path: Path) -> Qwen2_5OmniInputProcessor:
    return Qwen2_5OmniInputProcessor.from_pretrained(omni25_path)


def chat(fps: float, num_frames: int, seconds: float) -> list[dict]:
    """A standalone audio, a video with its track, an image, text."""
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (28, 42, 3), np.uint8))
    return [{"role": "system", "content": "You are Qwen."},
            {"role": "user", "content": [
                {"type": "audio", "audio": (tone(1.3, seed=1), 16000)},
                {"type": "video", "video": frames(num_frames), "fps": fps,
                 "audio": (tone(seconds, seed=2), 16000)},
                {"type": "image", "image": image},
                {"type": "text", "text": "What do you see and hear?"}]}]


def runs(ids: torch.Tensor, processor: Qwen2_5OmniInputProcessor) -> list[tuple[str, int]]:
    t = processor.tokens
    out: list[tuple[str, int]] = []
    for token in ids.tolist():
        name = {t.audio_pad: "A", t.video_pad: "V", t.image_pad: "I"}.get(token, "t")
        out[-1:] = [(name, out[-1][1] + 1)] if out and out[-1][0] == name else \
            out[-1:] + [(name, 1)]
    return out


@pytest.mark.parametrize("fps, num_frames, seconds", [
    (2.0, 10, 5.0),      # 5 temporal patches 25 positions apart, 125 audio tokens: 3 chunks
    (3.0, 7, 2.6),       # a fractional step (33.3 positions), rounded down; audio shorter
    (2.0, 6, 9.0),       # the audio outlasts the video: the last chunks are audio only
])
def test_matches_hf_processor_and_rope_index(processor: Qwen2_5OmniInputProcessor, omni25_hf,
                                             fps: float, num_frames: int,
                                             seconds: float) -> None:
    from transformers import Qwen2_5OmniProcessor

    messages = chat(fps, num_frames, seconds)
    ours = processor(messages)
    user = messages[1]["content"]
    hf = hf_processor(Qwen2_5OmniProcessor, processor, ours)
    ref = hf(text=[ours.prompt], audio=[user[0]["audio"][0], user[1]["audio"][0]],
             images=[user[2]["image"]], videos=[user[1]["video"]],
             audio_from_video_indices=[None, 0], use_audio_in_video=True,
             videos_kwargs={"fps": fps}, return_tensors="pt")
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    mask = ref["feature_attention_mask"].bool()
    assert torch.equal(ours.audio_feature_lens, mask.sum(-1))
    torch.testing.assert_close(ours.input_features,
                               ref["input_features"].permute(0, 2, 1)[mask].T, atol=0, rtol=0)
    layout = runs(ours.input_ids, processor)
    assert sum(n for name, n in layout if name == "V") == int(ours.video_grid_thw.prod() // 4)
    assert [name for name, _ in layout].count("V") >= 2          # interleaved, not one run

    kw = ours.hf_kwargs()
    positions, delta = omni25_hf.thinker.model.get_rope_index(
        kw["input_ids"], kw["image_grid_thw"], kw["video_grid_thw"], kw["attention_mask"],
        True, kw["feature_attention_mask"].sum(-1), kw["video_second_per_grid"])
    assert torch.equal(ours.positions, positions[:, 0])
    assert ours.rope_delta == int(delta)


def test_a_video_without_its_track_is_unchanged(processor: Qwen2_5OmniInputProcessor) -> None:
    video = frames(4)
    plain = processor([{"role": "user", "content": [{"type": "video", "video": video}]}])
    assert int((plain.input_ids == processor.tokens.audio_pad).sum()) == 0
    with pytest.raises(ValueError, match=r"content\[0\].use_audio_in_video: give the video's "):
        processor([{"role": "user", "content": [{"type": "video", "video": video,
                                                 "use_audio_in_video": True}]}])
