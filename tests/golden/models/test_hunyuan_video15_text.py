"""HunyuanVideo-1.5's prompt encoding (encode_hunyuan_video15_prompts on our Qwen2.5-VL and T5
encoders, loaded from a tiny random pipeline folder) against diffusers' own
`HunyuanVideo15Pipeline.encode_prompt` on the same folder, float32: a batch of prompts of
different lengths with and without quoted text (the byT5 glyph branch), the empty negative
prompt, num_videos_per_prompt (per prompt, where diffusers tiles the masks), the cast to the transformer's dtype, and `trim_padding`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, ByT5Tokenizer

from omnistage.models.text_encoders import (QwenTextEncoder, T5Encoder,
                                            encode_hunyuan_video15_prompts)
from omnistage.models.text_encoders.hunyuan_video15 import (GLYPH_MAX_LENGTH, MLLM_MAX_LENGTH,
                                                            glyph_text)
from tests.helpers.hunyuan_video15_parts import build_tiny_text_parts, build_tiny_vae

diffusers = pytest.importorskip("diffusers")

PROMPTS = ['A shop sign that reads "OPEN 24h" above a door, and “café” painted below, rain',
           "A cat walks on the grass, realistic",
           'Neon "HELLO" and "HELLO" again, then "bye"']
ATOL = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hv15_text")
    build_tiny_text_parts(path)
    return path


@pytest.fixture(scope="module")
def reference(folder: Path) -> diffusers.HunyuanVideo15Pipeline:
    """diffusers' pipeline over the folder's saved prompt side (no transformer: encode_prompt
    does not use it)."""
    import transformers
    return diffusers.HunyuanVideo15Pipeline(
        text_encoder=transformers.Qwen2_5_VLTextModel.from_pretrained(folder / "text_encoder"),
        tokenizer=AutoTokenizer.from_pretrained(folder / "tokenizer"),
        text_encoder_2=transformers.T5EncoderModel.from_pretrained(folder / "text_encoder_2"),
        tokenizer_2=ByT5Tokenizer.from_pretrained(folder / "tokenizer_2"),
        transformer=None, vae=build_tiny_vae(), scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        guider=diffusers.ClassifierFreeGuidance())


@pytest.fixture(scope="module")
def ours(folder: Path) -> dict[str, object]:
    return dict(text_encoder=QwenTextEncoder.from_pretrained(folder / "text_encoder"),
                tokenizer=AutoTokenizer.from_pretrained(folder / "tokenizer"),
                glyph_encoder=T5Encoder.from_pretrained(folder / "text_encoder_2"),
                glyph_tokenizer=ByT5Tokenizer.from_pretrained(folder / "tokenizer_2"))


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert (a - b).abs().max().item() < ATOL


@torch.no_grad()
def test_prompts_match_encode_prompt(reference: diffusers.HunyuanVideo15Pipeline,
                                     ours: dict[str, object]) -> None:
    expected = reference.encode_prompt(PROMPTS, device=torch.device("cpu"),
                                       batch_size=len(PROMPTS))
    got = encode_hunyuan_video15_prompts(prompts=PROMPTS, **ours)
    embeds, mask, embeds_2, mask_2 = expected
    assert embeds.shape == (3, MLLM_MAX_LENGTH, 32) and embeds_2.shape == (3, GLYPH_MAX_LENGTH, 24)
    lengths = mask.sum(dim=1)
    assert len(set(lengths.tolist())) == 3 and lengths.min() > 0  # three lengths, none empty
    assert embeds[mask.bool()].std() > 0.1                       # a scale the tolerance means
    assert mask_2[1].sum() == 0 and mask_2[0].sum() > 0 and mask_2[2].sum() > 0
    assert embeds_2[mask_2.bool()].std() > 0.1
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b)


@torch.no_grad()
def test_negative_prompt_and_repeats(reference: diffusers.HunyuanVideo15Pipeline,
                                     ours: dict[str, object]) -> None:
    """The pipeline's negative prompt None is [""] * batch; two videos per prompt; the cast
    to a half-precision transformer's dtype."""
    expected = reference.encode_prompt(None, device=torch.device("cpu"), dtype=torch.bfloat16,
                                       batch_size=2, num_videos_per_prompt=2)
    got = encode_hunyuan_video15_prompts(prompts=["", ""], dtype=torch.bfloat16,
                                         num_videos_per_prompt=2, **ours)
    assert got.prompt_embeds.shape[0] == 4 and got.prompt_embeds_mask_2.sum() == 0
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b)
    # Different prompts, two videos each: diffusers 0.42 repeats the embeddings per prompt
    # (p0 p0 p1 p1) but tiles the masks (m0 m1 m0 m1), so its masks no longer belong to
    # their rows; ours repeat both per prompt, i.e. its one-video answer, each row twice.
    once = reference.encode_prompt(PROMPTS[:2], device=torch.device("cpu"), batch_size=2)
    got = encode_hunyuan_video15_prompts(prompts=PROMPTS[:2], num_videos_per_prompt=2, **ours)
    for a, b in zip(got, once, strict=True):
        assert_close(a, b.repeat_interleave(2, dim=0))


@torch.no_grad()
def test_trim_padding_keeps_every_token_row(ours: dict[str, object]) -> None:
    full = encode_hunyuan_video15_prompts(prompts=PROMPTS, **ours)
    trimmed = encode_hunyuan_video15_prompts(prompts=PROMPTS, trim_padding=True, **ours)
    keep = full.prompt_embeds_mask.bool()
    assert_close(trimmed.prompt_embeds[keep], full.prompt_embeds[keep])
    assert trimmed.prompt_embeds[~keep].abs().max() == 0          # padding rows: zeros
    assert full.prompt_embeds[~keep].abs().max() > 0.1            # (HF's own values there)
    for a, b in zip(trimmed[1:], full[1:], strict=True):
        assert torch.equal(a, b)


def test_glyph_text() -> None:
    assert glyph_text("no quotes") is None
    assert glyph_text('one "A b"') == 'Text "A b". '
    assert glyph_text('"x" “y” "x"') == 'Text "x". Text "y". '
