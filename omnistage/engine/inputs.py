"""Turning the caller's prompt into what the entry stage takes, checked before submission."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch

from omnistage import registry
from omnistage.payloads import MEDIA_INPUTS, MM_POSITIONS, ROPE_DELTA
from omnistage.sampling_params import SamplingParams
from omnistage.stages.info import StageInfo

PromptType = Union[str, dict[str, Any]]
PROMPT_KEYS = {"prompt", "prompt_token_ids", "prompt_embeds", "multi_modal_data",
               "negative_prompt"}


@dataclass(slots=True)
class ParsedPrompt:
    text: str | None
    token_ids: list[int] | None
    embeds: torch.Tensor | None
    multimodal: dict[str, torch.Tensor] | None = None   # the entry model's other inputs

    @property
    def num_tokens(self) -> int:
        if self.embeds is not None:
            return self.embeds.shape[0]
        return len(self.token_ids or [])


def parse_prompt(prompt: PromptType, tokenizer: object | None, tokenize: bool = True
                 ) -> ParsedPrompt:
    """Raise ValueError naming the problem for any malformed prompt. With `tokenize` False
    (the entry stage reads text, as a diffusion stage does) the prompt must be text."""
    if not tokenize:
        text = prompt if isinstance(prompt, str) else (
            prompt.get("prompt") if isinstance(prompt, dict) else None)
        if not isinstance(text, str):
            raise ValueError("this model takes a text prompt: a string or {'prompt': ...}")
        if isinstance(prompt, dict) and set(prompt) - {"prompt", "negative_prompt"}:
            raise ValueError(f"prompt has unsupported keys "
                             f"{sorted(set(prompt) - {'prompt', 'negative_prompt'})} for this "
                             "model (it takes prompt, negative_prompt)")
        return ParsedPrompt(text, None, None)
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, _encode(prompt, tokenizer), None)
    if not isinstance(prompt, dict):
        raise ValueError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
    unknown = set(prompt) - PROMPT_KEYS
    if unknown:
        raise ValueError(f"prompt has unknown keys {sorted(unknown)}; known: {sorted(PROMPT_KEYS)}")
    if prompt.get("multi_modal_data"):
        raise ValueError("multi_modal_data: this model takes text only")
    given = [k for k in ("prompt", "prompt_token_ids", "prompt_embeds") if k in prompt]
    if len(given) != 1:
        raise ValueError("a prompt dict needs exactly one of prompt, prompt_token_ids, "
                         f"prompt_embeds (got {given or 'none'})")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError("prompt['prompt'] must be a string")
        return ParsedPrompt(prompt["prompt"], _encode(prompt["prompt"], tokenizer), None)
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of ints")
        return ParsedPrompt(None, list(ids), None)
    embeds = prompt["prompt_embeds"]
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 2:
        raise ValueError("prompt_embeds must be a torch.Tensor of shape (num_tokens, hidden)")
    return ParsedPrompt(None, None, embeds)


def load_input_processor(model_path: Path | None) -> Any | None:
    """The input processor of the model's family (chat templates, audio features, image
    patches: `from_pretrained(path)`, `parse_request(prompt)`), or None for models whose
    prompts are plain text / ids."""
    found = registry.match_folder(model_path) if model_path is not None else None
    if found is None or found.processor is None:
        return None
    return registry.load(found.processor).from_pretrained(model_path)


def parse_with_processor(prompt: PromptType, processor: Any) -> ParsedPrompt:
    """A multimodal model's prompt -> token ids with placeholders expanded, plus its feature
    tensors and rotary positions (for the entry stage)."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return parse_prompt(prompt, None)
    inputs = processor.parse_request(prompt)
    mm = {name: value for name in MEDIA_INPUTS
          if (value := getattr(inputs, name, None)) is not None}
    if mm and inputs.positions is not None:   # M-RoPE models' positions (others: None)
        mm[MM_POSITIONS] = inputs.positions
        mm[ROPE_DELTA] = torch.tensor(inputs.rope_delta)
    return ParsedPrompt(inputs.prompt, inputs.input_ids.tolist(), None, mm or None)


def _encode(text: str, tokenizer: Any) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass prompt_token_ids")
    return tokenizer(text, add_special_tokens=True)["input_ids"] if text else []


def check_prompt(parsed: ParsedPrompt, info: StageInfo) -> None:
    """Checks against the entry stage's facts (from its Ready handshake)."""
    if parsed.token_ids is None and parsed.embeds is None:  # text for a text-reading stage
        if not (parsed.text or "").strip():
            raise ValueError("prompt is empty")
        return
    n = parsed.num_tokens
    if n == 0:
        raise ValueError("prompt is empty")
    max_len = info.max_model_len
    if max_len is not None and n >= max_len:
        raise ValueError(f"prompt has {n} tokens, but the model's maximum length is {max_len} "
                         "(room for at least one new token needed)")
    vocab = info.vocab_size
    if vocab is not None and parsed.token_ids is not None:
        bad = [t for t in parsed.token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside the vocabulary "
                             f"[0, {vocab}): {bad[:5]}")
    hidden = info.hidden_size
    if parsed.embeds is not None and hidden is not None and parsed.embeds.shape[1] != hidden:
        raise ValueError(f"prompt_embeds has shape {tuple(parsed.embeds.shape)}, expected "
                         f"(num_tokens, {hidden})")


def check_params(params: SamplingParams, info: StageInfo) -> None:
    params.validate()
    num_layers = info.num_hidden_layers
    top = max(params.output_hidden_layers, default=0)
    if num_layers is not None and top > num_layers:
        raise ValueError(f"output_hidden_layers asks for layer {top}, the model has {num_layers} "
                         f"(0 = embeddings .. {num_layers} = final)")
