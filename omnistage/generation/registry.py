"""Generation models by name (a stage's `component`), imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

# component -> (module, class); the class has `from_pretrained(path, component, device, dtype)`
GENERATION_MODELS: dict[str, tuple[str, str]] = {
    "token_embedder": ("omnistage.testing.toy_pipeline", "TokenEmbedder"),
    "qwen3_omni_code2wav": ("omnistage.generation.code2wav", "Code2WavGenerator"),
}


def get_generation_model_class(component: str) -> type[nn.Module]:
    if component not in GENERATION_MODELS:
        known = ", ".join(sorted(GENERATION_MODELS))
        raise ValueError(f"generation component {component!r} is not registered (known: {known})")
    module, name = GENERATION_MODELS[component]
    return getattr(importlib.import_module(module), name)
