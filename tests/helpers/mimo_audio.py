"""A tiny servable MiMo-Audio folder: the upstream-built tiny checkpoint of
tests/fixtures/mimo_audio (its vocabulary widened to a tiny text tokenizer with MiMo-Audio's
special tokens), the tiny audio tokenizer under audio_tokenizer/, and one change that makes it
speak: a large value bias in the LLM's last layer puts a constant direction into every final
hidden state, and <|empty|>'s lm_head row gets part of it (the random model alone almost never
draws the speech id)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerFast

from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "mimo_audio"
SPECIAL = ["<|sosp|>", "<|eosp|>", "<|sostm|>", "<|eostm|>", "<|eot|>", "<|empty|>"]
ADDED = ["<think>", "</think>"]


def build_tiny_text_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """The tiny byte-level BPE (omnistage/testing/tiny_tokenizer.py) with MiMo-Audio's special
    tokens, saved to `folder`."""
    tok = build_tiny_tokenizer(folder)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *SPECIAL]})
    tok.add_tokens(ADDED)
    tok.save_pretrained(str(folder))
    return tok


def build_tiny_mimo_audio(folder: Path, speech_bias: float = 0.5,
                          audio_rate: int | None = None) -> Path:
    """-> `folder`, a MiMo-Audio checkpoint folder as released (config.json, safetensors, the
    tokenizer, audio_tokenizer/). `audio_rate`: the audio tokenizer's sampling_rate instead of
    the tiny 400 Hz, which is below any rate a request's audio may be resampled to (a server
    that hears requests needs one it takes; the weights are the same)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_text_tokenizer(folder)
    vocab = (len(tok) + 63) // 64 * 64
    cfg = json.loads((FIXTURES / "tiny" / "config.json").read_text())
    state = load_file(FIXTURES / "tiny" / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = state[name]
        extra = torch.randn(vocab - w.shape[0], w.shape[1], generator=gen) * float(w.std())
        state[name] = torch.cat([w, extra]).contiguous()
    last = cfg["num_hidden_layers"] - 1
    bias = f"model.layers.{last}.self_attn.v_proj.bias"
    state[bias] = state[bias] + 20.0
    o = state[f"model.layers.{last}.self_attn.o_proj.weight"]
    kv, heads = cfg["num_key_value_heads"], cfg["num_attention_heads"]
    d = o @ state[bias].view(kv, -1).repeat_interleave(heads // kv, 0).reshape(-1)
    d = d / d.norm() * state["model.norm.weight"]     # what the final norm makes of it
    empty = tok.convert_tokens_to_ids("<|empty|>")
    lm = state["lm_head.weight"]
    lm[empty] = lm[empty] + speech_bias * d / d.norm() * lm.norm(dim=1).mean()
    cfg["vocab_size"] = vocab
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(folder / "model.safetensors"))
    shutil.copytree(FIXTURES / "tokenizer", folder / "audio_tokenizer", dirs_exist_ok=True)
    if audio_rate is not None:
        speech = folder / "audio_tokenizer" / "config.json"
        speech.write_text(json.dumps({**json.loads(speech.read_text()),
                                      "sampling_rate": audio_rate}, indent=2))
    return folder
