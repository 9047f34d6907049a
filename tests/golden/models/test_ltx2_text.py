"""Golden: LTX-2's text side against diffusers, float32, on tiny random checkpoints saved in the
pipeline layout (tests/helpers/ltx2_text.py):

  - our LTX2TextConnectors against diffusers' on the same stacked hidden states (left-padded,
    prompts of different lengths), three variants: LTX-2.0 (registers, interleaved rope),
    LTX-2.3 (per-modality projections, gated attention, split rope) and without registers;
  - encode_ltx2_prompts (tokenizer + our Gemma 3 + our connectors, loaded from the folder)
    against LTX2Pipeline.encode_prompt followed by its connectors call, as __call__ makes
    them: prompts and negative prompts of different lengths, one truncated, the empty one;
    video and audio embeddings and the mask the transformer gets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import AutoTokenizer

from omnistage.models.ltx2_connectors import LTX2TextConnectors
from omnistage.models.text_encoders import Gemma3TextEncoder, encode_ltx2_prompts
from tests.helpers.ltx2_text import (CAPTION, CONNECTORS, GEMMA_LAYERS, REGISTERS,
                                     build_tiny_ltx2_text, tiny_connectors)

TOL = 1e-5
PROMPTS = ["  A cat jumps over the lazy dog.\n", "Hi",
           "The quick brown fox jumps over the lazy dog and the sun rises in the east."]
NEGATIVES = ["", "blurry", "low quality, worst"]


def max_err(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("variant", list(CONNECTORS))
def test_connectors_match_diffusers(tmp_path: Path, variant: str) -> None:
    ref = tiny_connectors(variant)
    ref.save_pretrained(tmp_path)
    ours = LTX2TextConnectors.from_pretrained(tmp_path)
    g = torch.Generator().manual_seed(0)
    seq_len, lengths = 3 * REGISTERS, [12, 2, 7]
    mask = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, seq_len - n:] = 1
    # Gemma-like: each layer its own scale and offset; padding rows not zero (as Gemma's)
    hidden = (torch.randn(3, seq_len, CAPTION, GEMMA_LAYERS + 1, generator=g)
              * torch.rand(GEMMA_LAYERS + 1, generator=g) * 5 + torch.randn(GEMMA_LAYERS + 1))
    with torch.no_grad():
        video, audio, out_mask = ref(hidden.flatten(2), mask, padding_side="left")
        got = ours(hidden, mask)
    assert video.abs().mean() > 0.3 and audio.abs().mean() > 0.3
    assert max_err(got[0], video) < TOL and max_err(got[1], audio) < TOL
    assert torch.equal(got[2], out_mask)
    with torch.no_grad():   # the 3D form diffusers also takes
        assert max_err(ours(hidden.flatten(2), mask)[0], video) < TOL
        # one prompt alone equals its row of the batch
        alone = ours(hidden[1:2], mask[1:2])
    assert max_err(alone[0], video[1:2]) < TOL and max_err(alone[1], audio[1:2]) < TOL


def reference(pipe, prompts: list[str], negatives: list[str] | None, seq_len: int
              ) -> tuple[Tensor, Tensor, Tensor]:
    """LTX2Pipeline.__call__'s step 3: encode_prompt, [negative, positive], connectors."""
    guided = negatives is not None
    with torch.no_grad():
        embeds, mask, neg_embeds, neg_mask = pipe.encode_prompt(
            prompts, negatives, do_classifier_free_guidance=guided,
            max_sequence_length=seq_len, device="cpu")
        if guided:
            embeds, mask = torch.cat([neg_embeds, embeds]), torch.cat([neg_mask, mask])
        return pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)


@pytest.mark.parametrize("variant, pad", [("ltx2.0", True), ("ltx2.3", False)],
                         ids=["ltx2.0", "ltx2.3-no-pad-token"])
def test_prompts_encode_as_the_pipeline_does(tmp_path: Path, variant: str, pad: bool) -> None:
    pipe = build_tiny_ltx2_text(tmp_path, variant, pad)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert (tokenizer.pad_token is not None) == pad
    encoder = Gemma3TextEncoder.from_pretrained(tmp_path / "text_encoder")
    connectors = LTX2TextConnectors.from_pretrained(tmp_path / "connectors")
    seq_len = 3 * REGISTERS   # the longest prompt is truncated to it, "" is one token (<bos>)
    video, audio, mask = reference(pipe, PROMPTS, NEGATIVES, seq_len)
    assert video.abs().mean() > 0.3 and audio.abs().mean() > 0.3
    positive, negative = encode_ltx2_prompts(tokenizer, encoder, connectors, PROMPTS,
                                             NEGATIVES, max_sequence_length=seq_len)
    n = len(PROMPTS)
    for ours, rows in ((negative, slice(0, n)), (positive, slice(n, None))):
        assert max_err(ours.video, video[rows]) < TOL
        assert max_err(ours.audio, audio[rows]) < TOL
        assert torch.equal(ours.mask, mask[rows])
    # without guidance: the prompts alone, the same rows
    video, audio, mask = reference(pipe, PROMPTS[:2], None, seq_len)
    positive, negative = encode_ltx2_prompts(tokenizer, encoder, connectors, PROMPTS[:2],
                                             max_sequence_length=seq_len)
    assert negative is None and len(positive) == 2
    assert max_err(positive.video, video) < TOL and max_err(positive.audio, audio) < TOL
    # only some requests guided: fewer negatives, their rows in order
    positive, negative = encode_ltx2_prompts(tokenizer, encoder, connectors, PROMPTS,
                                             NEGATIVES[2:], max_sequence_length=seq_len)
    video, audio, mask = reference(pipe, PROMPTS[2:], NEGATIVES[2:], seq_len)
    assert len(positive) == 3 and len(negative) == 1
    assert max_err(negative.video, video[:1]) < TOL and max_err(negative.audio, audio[:1]) < TOL
    assert max_err(positive.video[2:], video[1:]) < TOL
    # the shared tokenizer keeps its padding side
    assert tokenizer.padding_side == "right"


def test_bad_input_is_named(tmp_path: Path) -> None:
    build_tiny_ltx2_text(tmp_path, "ltx2.0")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    encoder = Gemma3TextEncoder.from_pretrained(tmp_path / "text_encoder")
    connectors = LTX2TextConnectors.from_pretrained(tmp_path / "connectors")
    assert connectors.sequence_multiple == 4
    with pytest.raises(ValueError, match="max_sequence_length: 10 tokens.*multiple of 4"):
        encode_ltx2_prompts(tokenizer, encoder, connectors, ["a"], max_sequence_length=10)
    with pytest.raises(ValueError, match="prompts: empty"):
        encode_ltx2_prompts(tokenizer, encoder, connectors, [])
    other = tiny_connectors("ltx2.0", num_states=GEMMA_LAYERS)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="gives 4 hidden states of 24; the connectors take 3"):
        encode_ltx2_prompts(tokenizer, encoder,
                            LTX2TextConnectors.from_pretrained(tmp_path / "other"), ["a"])


def test_connectors_config_is_checked() -> None:
    from omnistage.models.ltx2_connectors import LTX2TextConnectorsConfig
    with pytest.raises(ValueError, match="rope_type='spiral'"):
        LTX2TextConnectorsConfig(rope_type="spiral")
    with pytest.raises(ValueError, match="the video connector is 64 wide"):
        LTX2TextConnectorsConfig(caption_channels=32, video_connector_num_attention_heads=2,
                                 video_connector_attention_head_dim=32)
