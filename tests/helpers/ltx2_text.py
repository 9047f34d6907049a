"""LTX-2's text side, tiny and random, built with the reference's own classes and saved with
`save_pretrained` in the diffusers pipeline layout:

    folder/text_encoder/   Gemma3ForConditionalGeneration (tiny SigLIP vision tower included,
                           as LTX-2 ships it; only the language model is used)
    folder/tokenizer/      the tiny BPE tokenizer, made to put a <bos> first as Gemma's does
    folder/connectors/     diffusers' LTX2TextConnectors
    folder/model_index.json

`build_tiny_ltx2_text` returns diffusers' `LTX2Pipeline` holding these three (its other parts
None): its `encode_prompt` and `connectors` are the reference. `add_tiny_text_encoder` puts a
Gemma 3 and tokenizer that fit given connectors into an existing pipeline folder.

Connector variants: "ltx2.0" (shared text_proj_in, learnable registers, interleaved rope),
"ltx2.3" (per-modality projections with bias, gated attention, split rope, registers) and
"masked" (no registers: padded keys masked, the mask handed on)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from tokenizers import processors
from torch import nn
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, PreTrainedTokenizerFast

from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

CAPTION = 24          # Gemma's hidden size = the connectors' caption_channels
GEMMA_LAYERS = 3      # -> 4 hidden states stacked (text_proj_in_factor)
REGISTERS = 4         # learnable registers: max_sequence_length must be a multiple
CONNECTORS: dict[str, dict[str, Any]] = {
    "ltx2.0": dict(video_connector_num_learnable_registers=REGISTERS,
                   audio_connector_num_learnable_registers=REGISTERS, rope_type="interleaved"),
    "ltx2.3": dict(video_connector_num_learnable_registers=REGISTERS,
                   audio_connector_num_learnable_registers=REGISTERS, rope_type="split",
                   per_modality_projections=True, video_hidden_dim=16, audio_hidden_dim=12,
                   proj_bias=True, video_gated_attn=True, audio_gated_attn=True,
                   rope_double_precision=False),
    "masked": dict(video_connector_num_learnable_registers=None,
                   audio_connector_num_learnable_registers=None, rope_type="interleaved"),
}


@torch.no_grad()
def randomize(model: nn.Module, seed: int) -> nn.Module:
    """Norm weights and biases drawn too (HF zeroes Gemma's norm offsets and the biases,
    which would hide a lost one); matrices scaled by 1/sqrt(fan-in) so activations stay O(1)."""
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1 or "registers" in name:
            p.copy_(0.3 * torch.randn_like(p))
        elif "embed" in name:
            p.copy_(torch.randn_like(p))
        else:
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    return model.eval()


def tiny_gemma_tokenizer(path: Path, pad: bool = True) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with a <bos> ("<|im_start|>") put before every text, as Gemma's
    tokenizer does ("" is then one token, never none); pad=False: no pad token (diffusers
    then pads with eos)."""
    tokenizer = build_tiny_tokenizer(path)
    bos = "<|im_start|>"
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))])
    tokenizer.bos_token = bos
    if not pad:
        tokenizer.pad_token = None
    tokenizer.save_pretrained(path)
    return tokenizer


def tiny_gemma3(vocab_size: int, hidden: int = CAPTION, num_layers: int = GEMMA_LAYERS,
                seed: int = 0) -> Gemma3ForConditionalGeneration:
    """Sliding (window 3) and full layers alternating, full layers' rope linearly scaled (as
    Gemma-3-12B), GQA, query_pre_attn_scalar unlike head_dim, a tiny SigLIP tower."""
    kinds = ["sliding_attention", "full_attention"]
    text = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                head_dim=2 * (hidden // 8 + 1), query_pre_attn_scalar=hidden // 2, sliding_window=3,
                layer_types=[kinds[i % 2] for i in range(num_layers)],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                       "rope_theta": 1000.0}},
                pad_token_id=0, eos_token_id=1, bos_token_id=2)
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=7)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(seed)
    return randomize(Gemma3ForConditionalGeneration(config), seed)


def tiny_connectors(variant: str, caption: int = CAPTION,
                    num_states: int = GEMMA_LAYERS + 1, seed: int = 1) -> nn.Module:
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    widths = CONNECTORS[variant]
    video = widths.get("video_hidden_dim", caption)
    audio = widths.get("audio_hidden_dim", caption)
    torch.manual_seed(seed)
    model = LTX2TextConnectors(
        caption_channels=caption, text_proj_in_factor=num_states,
        video_connector_num_attention_heads=2, video_connector_attention_head_dim=video // 2,
        video_connector_num_layers=2, audio_connector_num_attention_heads=3,
        audio_connector_attention_head_dim=audio // 3, audio_connector_num_layers=1,
        connector_rope_base_seq_len=16, rope_theta=1000.0, **widths)
    return randomize(model, seed)


def build_tiny_ltx2_text(path: Path, variant: str = "ltx2.0", pad: bool = True) -> Any:
    """The tiny text side saved at `path` -> diffusers' LTX2Pipeline holding it (float32,
    CPU), the reference for encode_prompt and the connectors."""
    from diffusers import LTX2Pipeline
    tokenizer = tiny_gemma_tokenizer(path / "tokenizer", pad)
    pipe = LTX2Pipeline(scheduler=None, vae=None, audio_vae=None,
                        text_encoder=tiny_gemma3(len(tokenizer)), tokenizer=tokenizer,
                        connectors=tiny_connectors(variant), transformer=None, vocoder=None)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(path)
    return pipe


def add_tiny_text_encoder(path: Path, seed: int = 0) -> None:
    """A Gemma 3 (text_encoder/) and tokenizer (tokenizer/) fitting the connectors/ already
    in the pipeline folder `path` (their caption_channels and text_proj_in_factor), so a
    tiny pipeline built without a text encoder takes prompts. model_index.json is left as
    it was, but for its text_encoder and tokenizer entries."""
    import json
    connectors = json.loads((path / "connectors" / "config.json").read_text())
    hidden, states = connectors["caption_channels"], connectors["text_proj_in_factor"]
    tokenizer = tiny_gemma_tokenizer(path / "tokenizer")
    tiny_gemma3(len(tokenizer), hidden, states - 1, seed).save_pretrained(path / "text_encoder")
    index = json.loads((path / "model_index.json").read_text())
    index["text_encoder"] = ["transformers", "Gemma3ForConditionalGeneration"]
    index["tokenizer"] = ["transformers", "PreTrainedTokenizerFast"]
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
