"""Qwen3-Omni's prefix-cache ids for multimodal prompts: each media item's placeholder run
becomes the digest of that item's features, so equal media hit and other media do not."""

from __future__ import annotations

import torch

from omnistage.models.qwen3_omni.multimodal import SpecialTokens
from omnistage.stages.media import media_cache_ids

TOKENS = SpecialTokens(audio_start=1, audio_pad=2, audio_end=3, vision_start=4, image_pad=5,
                       video_pad=6, vision_end=7)
IDS = [10, 1, 2, 2, 2, 3, 11, 1, 2, 2, 3, 12]          # two audios: 3 and 2 placeholders


def audio(first: torch.Tensor, second: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_features": torch.cat([first, second], dim=1),
            "audio_feature_lens": torch.tensor([first.shape[1], second.shape[1]])}


def test_each_audio_run_hashes_its_own_features() -> None:
    a, b = torch.randn(8, 30), torch.randn(8, 20)
    ids = media_cache_ids(IDS, audio(a, b), TOKENS)
    assert ids is not None and len(ids) == len(IDS)
    assert [i for i, t in zip(ids, IDS) if t != 2] == [t for t in IDS if t != 2]
    first, second = set(ids[2:5]), set(ids[8:10])
    assert len(first) == len(second) == 1 and first != second
    assert min(ids[2:5] + ids[8:10]) < 0                  # never a token id
    assert media_cache_ids(IDS, audio(a, b), TOKENS) == ids
    changed = media_cache_ids(IDS, audio(a, b + 1e-3), TOKENS)
    assert changed is not None and changed[:8] == ids[:8] and changed[8:10] != ids[8:10]


def test_runs_that_do_not_match_the_items_are_not_cached() -> None:
    one = {"input_features": torch.randn(8, 30), "audio_feature_lens": torch.tensor([30])}
    assert media_cache_ids(IDS, one, TOKENS) is None
