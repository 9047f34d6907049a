"""Golden: our Gemma 3 text encoder against transformers' Gemma3ForConditionalGeneration on the
same tiny random checkpoint (float32): every hidden state (HF's output_hidden_states, stacked as
LTX-2 stacks them) for a left-padded batch of prompts of different lengths, sliding-window and
full layers with their own rotary (linear scaling on the full ones), GQA; the checkpoint
layouts it must accept, and loading that fails by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor
from transformers import Gemma3ForCausalLM, Qwen3Config, Qwen3Model

from omnistage.models.text_encoders import Gemma3TextEncoder
from omnistage.models.text_encoders.gemma3 import attention_masks
from omnistage.testing.tiny_models import edit_checkpoint
from tests.helpers.ltx2_text import randomize, tiny_gemma3

TOL = 1e-5
VOCAB = 96
LENGTHS = [11, 3, 7]   # real tokens per row, left-padded to S = 11 (> the sliding window, 3)


def left_padded(lengths: list[int], seed: int = 1) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    seq_len = max(lengths)
    ids = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    mask = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, seq_len - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[row, seq_len - n:] = 1
    return ids, mask


def err(got: Tensor, expected: Tensor, mask: Tensor) -> float:
    """Max abs difference over the prompt tokens' rows (every layer)."""
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return (got - expected)[mask.bool()].abs().max().item()


def hf_states(model: torch.nn.Module, ids: Tensor, mask: Tensor | None) -> Tensor:
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return torch.stack(out.hidden_states, dim=-1)                          # (B, S, D, L+1)


def test_matches_transformers_on_a_left_padded_batch(tmp_path: Path) -> None:
    ref = tiny_gemma3(VOCAB)
    ref.save_pretrained(tmp_path)
    ours = Gemma3TextEncoder.from_pretrained(tmp_path)
    ids, mask = left_padded(LENGTHS)
    expected = hf_states(ref, ids, mask)
    assert expected[..., -1].abs().mean() > 0.3 and expected[..., 1].abs().mean() > 0.3
    with torch.no_grad():
        got = ours(ids, mask)
    assert got.shape == expected.shape == (3, 11, 24, 4)
    assert err(got, expected, mask) < TOL                        # every prompt token, layer
    # padding rows: unread, finite, and no query row is left without a key (a GPU kernel
    # could answer NaN there, which would reach the real rows in the next layer)
    assert got.isfinite().all()
    for kind_mask in attention_masks(mask, mask.shape[1], 3, torch.device("cpu")).values():
        assert kind_mask.any(dim=-1).all()
    with torch.no_grad():   # no mask, rows longer than the window: HF's is_causal path
        assert (ours(ids) - hf_states(ref, ids, None)).abs().max() < TOL
    # one prompt alone equals its row in the batch (the left padding changes nothing else
    # but the positions, which HF numbers 0..S-1 whatever the padding, as we do)
    row = 1
    with torch.no_grad():
        alone = ours(ids[row:row + 1], mask[row:row + 1])
    assert err(alone, expected[row:row + 1], mask[row:row + 1]) < TOL


def test_each_ingredient_matters(tmp_path: Path) -> None:
    """The test above would see a lost rope scaling or sliding window: each changes the hidden
    states far beyond the tolerance."""
    tiny_gemma3(VOCAB).save_pretrained(tmp_path)
    ours = Gemma3TextEncoder.from_pretrained(tmp_path)
    ids, mask = left_padded(LENGTHS)
    with torch.no_grad():
        base = ours(ids, mask)
        ours.inv_freq_cpu["full_attention"] *= 8.0          # linear factor forgotten
        assert (ours(ids, mask) - base)[mask.bool()].abs().max() > 1e-2
        ours.inv_freq_cpu["full_attention"] /= 8.0
        window = ours.config.sliding_window
        object.__setattr__(ours.config, "sliding_window", 100)   # no window
        assert (ours(ids, mask) - base)[mask.bool()].abs().max() > 1e-2
        object.__setattr__(ours.config, "sliding_window", window)
        assert (ours(ids, mask) - base).abs().max() == 0


def test_layouts(tmp_path: Path) -> None:
    """transformers saves Gemma3ForConditionalGeneration as `language_model.model.*` (v5);
    other saves hold `model.language_model.*`; Gemma3ForCausalLM is `model.*`."""
    ref = tiny_gemma3(VOCAB)
    ref.save_pretrained(tmp_path / "mm")
    stored = load_file(tmp_path / "mm" / "model.safetensors")
    assert any(k.startswith("language_model.model.layers.") for k in stored)
    assert any(k.startswith("vision_tower.") for k in stored)
    ids, mask = left_padded(LENGTHS)
    expected = hf_states(ref, ids, mask)

    def renamed(w: dict[str, Tensor]) -> None:
        for k in list(w):
            new = k.replace("language_model.model.", "model.language_model.")
            new = new.replace("vision_tower.", "model.vision_tower.")
            w[new] = w.pop(k)
    ref.save_pretrained(tmp_path / "new")
    edit_checkpoint(tmp_path / "new", renamed)
    with torch.no_grad():
        got = Gemma3TextEncoder.from_pretrained(tmp_path / "new")(ids, mask)
    assert err(got, expected, mask) < TOL

    causal = randomize(Gemma3ForCausalLM(ref.config.text_config), 3)
    causal.save_pretrained(tmp_path / "causal")
    with torch.no_grad():
        got = Gemma3TextEncoder.from_pretrained(tmp_path / "causal")(ids, mask)
    assert err(got, hf_states(causal, ids, mask), mask) < TOL


def test_strict_loading_names_bad_tensors(tmp_path: Path) -> None:
    tiny_gemma3(VOCAB).save_pretrained(tmp_path)
    original = load_file(tmp_path / "model.safetensors")
    stored = "language_model.model.layers.2.post_feedforward_layernorm.weight"
    edit_checkpoint(tmp_path, lambda w: w.pop(stored))
    with pytest.raises(ValueError, match="missing tensors: layers.2.post_feedforward"):
        Gemma3TextEncoder.from_pretrained(tmp_path)

    def misshape(w: dict[str, Tensor]) -> None:
        w.update(original)
        w["language_model.model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    edit_checkpoint(tmp_path, misshape)
    with pytest.raises(ValueError, match="up_proj.*expected shape"):
        Gemma3TextEncoder.from_pretrained(tmp_path)

    def unexpected(w: dict[str, Tensor]) -> None:
        w.clear()
        w.update(original)
        w["language_model.model.extra.weight"] = torch.zeros(2)
    edit_checkpoint(tmp_path, unexpected)
    with pytest.raises(ValueError, match=r"unexpected tensors .*extra\.weight"):
        Gemma3TextEncoder.from_pretrained(tmp_path)


def test_refuses_what_it_does_not_compute(tmp_path: Path) -> None:
    Qwen3Model(Qwen3Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=8)).save_pretrained(tmp_path / "qwen")
    with pytest.raises(ValueError, match="model_type 'qwen3': not a Gemma 3"):
        Gemma3TextEncoder.from_pretrained(tmp_path / "qwen")
    ref = tiny_gemma3(VOCAB)
    ref.config.text_config.attn_logit_softcapping = 50.0
    ref.save_pretrained(tmp_path / "softcap")
    with pytest.raises(NotImplementedError, match="attn_logit_softcapping"):
        Gemma3TextEncoder.from_pretrained(tmp_path / "softcap")
    ref.config.text_config.attn_logit_softcapping = None
    ref.config.text_config.rope_parameters["full_attention"] = {
        "rope_type": "yarn", "factor": 8.0, "rope_theta": 1000.0}
    ref.save_pretrained(tmp_path / "yarn")
    with pytest.raises(NotImplementedError, match="rope_type 'yarn'"):
        Gemma3TextEncoder.from_pretrained(tmp_path / "yarn")
