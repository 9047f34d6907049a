"""Qwen3: the Qwen2 decoder plus an RMSNorm over each head of q and k before rotary, and no
q/k/v bias unless `attention_bias` (both read from `ModelConfig`, set by `from_hf`)."""

from __future__ import annotations

from omnistage.models.config import ModelConfig
from omnistage.models.qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        assert config.has_qk_norm, f"Qwen3 has q/k norm; model_type {config.model_type!r} says no"
        super().__init__(config)
