"""BAGEL's understanding expert alone, for text answers on the AR engine (paged KV cache,
continuous batching, prefix caching): on text rows BAGEL's MoT LLM is a Qwen2 decoder with
per-head q/k RMSNorm, so our `Qwen2ForCausalLM` runs it, loaded from ema.safetensors
(`language_model.*`, the generation expert's `*_moe_gen` tensors and the image parts left out).

The prompt is the upstream inferencer's, not Qwen's chat template: every text segment is
`<|im_start|> text <|im_end|>` at consecutive positions, and the answer starts by feeding
`<|im_start|>`; it ends at `<|im_end|>` (`answer_prompt`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import Qwen2Config

from omnistage.models.config import ModelConfig
from omnistage.models.qwen2 import Qwen2ForCausalLM

PREFIX = "language_model."


def answer_prompt(segments: list[list[int]], bos: int, eos: int) -> list[int]:
    """Token ids of text segments as the upstream lays them out, then the answer's start."""
    ids: list[int] = []
    for seg in segments:
        ids += [bos, *seg, eos]
    return [*ids, bos]


def load_understanding(path: str | Path, device: torch.device,
                       dtype: torch.dtype | None = None
                       ) -> tuple[Qwen2ForCausalLM, ModelConfig, Qwen2Config]:
    """An AR engine loader: (model, ModelConfig, hf_config) of the understanding expert."""
    path = Path(path)
    raw = json.loads((path / "llm_config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    hf = Qwen2Config(**raw, architectures=["Qwen2ForCausalLM"])
    cfg = dataclasses.replace(ModelConfig.from_hf(hf), has_qk_norm=True, attention_bias=True,
                              o_proj_bias=False, tie_word_embeddings=False)
    dtype = dtype or torch.float32
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    with safe_open(str(path / "ema.safetensors"), framework="pt", device="cpu") as f:
        names = [n for n in f.keys() if n.startswith(PREFIX) and "_moe_gen" not in n]
        loaded = model.load_weights((n[len(PREFIX):], f.get_tensor(n)) for n in names)
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"{path / 'ema.safetensors'}: no tensors for {sorted(missing)[:8]}")
    return model.to(device=device, dtype=dtype).eval(), cfg, hf
