"""Golden: our Moshi (omnistage/models/moshi/) against transformers'
`MoshiForConditionalGeneration.generate` (greedy) on the same tiny random checkpoint, loaded
from the folder transformers saved: for a batch of two prompts of different lengths (text, the
user's audio as a waveform encoded by our Mimi, Moshi's own codes), the inner-monologue text
tokens and Moshi's audio codes identical to each prompt's own reference run for several
frames, and the reference's waveform from our codec."""

from __future__ import annotations

import pytest
import torch

from omnistage.models.moshi.model import MoshiForConditionalGeneration, MoshiPrompt
from omnistage.testing.tiny_moshi import build_tiny_moshi

K, FRAME, NUM_FRAMES = 3, 96, 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path, ref = build_tiny_moshi(tmp_path_factory.mktemp("moshi") / "moshi")
    return MoshiForConditionalGeneration.from_pretrained(path), ref


def _inputs(num: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 50, (num,), generator=g)
    user = 0.3 * torch.randn(1, 1, num * FRAME - 17, generator=g)    # last frame partial
    moshi = torch.randint(0, 64, (K, num), generator=g)
    return text, user, moshi


def test_generate_equals_transformers_batch_of_two(models):
    ours, ref = models
    prompts, want = [], []
    for num, seed in ((3, 1), (5, 2)):
        text, user, moshi = _inputs(num, seed)
        with torch.no_grad():
            out = ref.generate(input_ids=text[None], user_input_values=user,
                               moshi_audio_codes=moshi[None], max_new_tokens=NUM_FRAMES,
                               do_sample=False, return_audio_codes=True)
            user_codes = ref.audio_encoder.encode(user, num_quantizers=K).audio_codes[0]
        assert torch.equal(ours.audio_encoder.encode(user, K)[0], user_codes)
        prompts.append(MoshiPrompt(text, user_codes, moshi))
        want.append(out)
    got = ours.generate(prompts, NUM_FRAMES)
    assert got.text_ids.shape == (2, NUM_FRAMES)
    assert got.audio_codes.shape == (2, K, NUM_FRAMES - 1)
    for i, (prompt, out) in enumerate(zip(prompts, want)):
        num = prompt.text_ids.shape[0]
        assert torch.equal(out.sequences[0, :num + 1], torch.cat([torch.tensor([50]),
                                                                  prompt.text_ids]))
        assert torch.equal(got.text_ids[i], out.sequences[0, num + 1:])
        assert torch.equal(got.audio_codes[i], out.audio_codes[0, :, num:])
        assert len(got.text_ids[i].unique()) > 2                   # not one token repeated
        wave = ours.audio_encoder.decode(out.audio_codes)
        assert out.audio_sequences.abs().max() > 0.5
        torch.testing.assert_close(wave, out.audio_sequences, atol=1e-4, rtol=0)


def test_prompt_shapes_checked(models):
    ours, _ = models
    text, _, moshi = _inputs(3, 1)
    with pytest.raises(ValueError, match="user_codes"):
        ours.generate([MoshiPrompt(text, moshi[:, :2], moshi)], 2)
