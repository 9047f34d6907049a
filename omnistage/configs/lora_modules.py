"""`omnistage serve --lora-modules`: LoRA adapters loaded at start, in vLLM's two forms.

    --lora-modules watercolor=/loras/watercolor.safetensors ink=/loras/ink
    --lora-modules '{"name": "watercolor", "path": "/loras/w.safetensors",
                     "base_model_name": "Qwen/Qwen-Image"}'

Each becomes a `LoraModule`; the server loads them (entrypoints/openai/lora_adapters.py) before
it answers, and does not start if one fails. Pure parsing: nothing here reads the files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_JSON_KEYS = {"name", "path", "base_model_name"}


@dataclass(frozen=True, slots=True)
class LoraModule:
    name: str
    path: str
    base_model_name: str | None = None     # vLLM's: the card's parent (default: the served)


def parse_lora_module(text: str) -> LoraModule:
    """One `--lora-modules` value: `name=path` or a JSON object with name, path and optional
    base_model_name. ValueError naming the value."""
    text = text.strip()
    if text.startswith("{"):
        return _from_json(text)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"lora_modules: {text!r}: expected name=path or a JSON object "
                         '{"name": ..., "path": ...}')
    return LoraModule(name.strip(), path.strip())


def _from_json(text: str) -> LoraModule:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"lora_modules: {text!r}: not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"lora_modules: {text!r}: expected a JSON object")
    unknown = sorted(set(value) - _JSON_KEYS)
    if unknown:
        raise ValueError(f"lora_modules: {text!r}: unknown keys {unknown} (known: "
                         f"{sorted(_JSON_KEYS)})")
    fields = {k: value.get(k) for k in _JSON_KEYS}
    for key in ("name", "path"):
        if not isinstance(fields[key], str) or not fields[key].strip():
            raise ValueError(f"lora_modules: {text!r}: `{key}` must be a non-empty string")
    base = fields["base_model_name"]
    if base is not None and not isinstance(base, str):
        raise ValueError(f"lora_modules: {text!r}: `base_model_name` must be a string")
    return LoraModule(fields["name"].strip(), fields["path"].strip(), base)


def parse_lora_modules(values: tuple[str, ...]) -> tuple[LoraModule, ...]:
    """Every `--lora-modules` value parsed; a name given twice is a ValueError."""
    modules = tuple(parse_lora_module(v) for v in values)
    names = [m.name for m in modules]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"lora_modules: {twice} given more than once")
    return modules
