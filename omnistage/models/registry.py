"""HF architecture name -> model class, imported only when asked for."""

from __future__ import annotations

import importlib

from torch import nn

# architecture (config.json "architectures"[0]) -> (module under omnistage.models, class)
_MODELS: dict[str, tuple[str, str]] = {
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported "
                         f"(supported: {', '.join(supported_architectures())})")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"omnistage.models.{module}"), name)
