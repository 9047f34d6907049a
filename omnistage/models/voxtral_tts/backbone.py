"""Voxtral-TTS's backbone: a Mistral decoder (causal, RoPE, GQA, no biases) read from the
release's consolidated.safetensors, on our Qwen2Model (the same layer without q/k/v biases).

Mistral's consolidated files keep Meta's interleaved rotary layout in wq / wk (pairs (2i, 2i+1)
rotate together); our rotary rotates halves (i, i + D/2), so the rows of each head are permuted
at load, as transformers' and vLLM's Mistral conversions do. Names:

    mm_audio_embeddings.tok_embeddings.weight -> model.embed_tokens.weight
    layers.N.attention.wq / wk / wv / wo      -> model.layers.N.self_attn.q/k/v_proj / o_proj
    layers.N.feed_forward.w1 / w3 / w2        -> model.layers.N.mlp.gate_proj / up_proj / down_proj
    layers.N.attention_norm / ffn_norm        -> input_layernorm / post_attention_layernorm
    norm.weight                               -> model.norm.weight
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import Tensor

from omnistage.models.config import ModelConfig
from omnistage.models.loader import load_packed_weights
from omnistage.models.qwen2 import Qwen2ForCausalLM, Qwen2Model
from omnistage.models.voxtral_tts.config import load_consolidated, read_params

_LAYER = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
          "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
          "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
          "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
          "ffn_norm": "post_attention_layernorm"}


def backbone_config(params: dict) -> ModelConfig:
    """params.json's top level -> the decoder's ModelConfig; a rope scaling we do not port is
    refused by name."""
    for key in ("yarn", "rope_scaling", "llama_4_scaling"):
        if params.get(key):
            raise NotImplementedError(f"Voxtral-TTS params.json: {key} is not ported")
    theta = float(params.get("rope_theta", 1e6))
    return ModelConfig(
        architecture="VoxtralTTSForConditionalGeneration", model_type="voxtral_tts",
        vocab_size=params["vocab_size"], hidden_size=params["dim"],
        intermediate_size=params["hidden_dim"], num_hidden_layers=params["n_layers"],
        num_attention_heads=params["n_heads"], num_key_value_heads=params["n_kv_heads"],
        head_dim=params.get("head_dim") or params["dim"] // params["n_heads"],
        rms_norm_eps=params.get("norm_eps", 1e-5), rope_theta=theta,
        max_position_embeddings=params.get("max_seq_len", 65536),
        tie_word_embeddings=bool(params.get("tied_embeddings", True)),
        rope_parameters={"rope_type": "default", "rope_theta": theta})


def unpermute(w: Tensor, n_heads: int) -> Tensor:
    """Meta's interleaved rotary rows -> halves, per head: (H*D, in) -> (H*D, in)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def our_names(raw: dict[str, Tensor], cfg: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    """The release's backbone tensors under our names (wq / wk un-permuted)."""
    for name, t in raw.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
        if m and m.group(2) in _LAYER:
            if m.group(2) == "attention.wq":
                t = unpermute(t, cfg.num_attention_heads)
            elif m.group(2) == "attention.wk":
                t = unpermute(t, cfg.num_key_value_heads)
            yield f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight", t
        elif name == "norm.weight":
            yield "model.norm.weight", t
        elif name == "mm_audio_embeddings.tok_embeddings.weight":
            yield "model.embed_tokens.weight", t


def load_backbone(folder: str | Path, device: str = "cpu",
                  dtype: torch.dtype = torch.float32) -> Qwen2Model:
    """The decoder with every parameter loaded from consolidated.safetensors (strict: a
    parameter the file lacks raises ValueError naming it)."""
    params, _, _ = read_params(folder)
    cfg = backbone_config(params)
    model = Qwen2Model(cfg).to(device=device, dtype=dtype)
    raw = load_consolidated(folder, "", device)
    loaded = _load(model, our_names(raw, cfg))
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"{folder}: consolidated.safetensors lacks {sorted(missing)[:4]}")
    return model.eval()


def _load(model: Qwen2Model, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
    stripped = ((n[len("model."):], t) for n, t in weights)
    return load_packed_weights(model, stripped, Qwen2ForCausalLM.packed_modules)
