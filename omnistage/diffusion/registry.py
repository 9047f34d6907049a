"""Diffusion pipelines by name (a stage's `component`), imported lazily."""

from __future__ import annotations

import importlib

# component -> (module, class); the class has `from_pretrained(path, component, device, dtype)`
DIFFUSION_PIPELINES: dict[str, tuple[str, str]] = {
    "digits_dit": ("omnistage.diffusion.pipelines.digits", "DigitsPipeline"),
    "flux": ("omnistage.diffusion.pipelines.flux", "FluxPipeline"),
    "z_image": ("omnistage.diffusion.pipelines.z_image", "ZImagePipeline"),
    "qwen_image": ("omnistage.diffusion.pipelines.qwen_image", "QwenImagePipeline"),
}


def get_pipeline_class(component: str) -> type:
    if component not in DIFFUSION_PIPELINES:
        known = ", ".join(sorted(DIFFUSION_PIPELINES))
        raise ValueError(f"diffusion component {component!r} is not registered (known: {known})")
    module, name = DIFFUSION_PIPELINES[component]
    return getattr(importlib.import_module(module), name)
