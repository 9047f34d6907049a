"""The text side of FLUX.2 (flux2.py): its prompt encoders and request checks.

    dev    Mistral-3 (Mistral Small 3.1's language model), system message + user prompt in
           its chat template -> hidden states 10, 20, 30        (Flux2Pipeline)
    klein  Qwen3, user prompt in its chat template, thinking off -> hidden states 9, 18, 27
                                                                 (Flux2KleinPipeline)

Both pad to max_sequence_length (512) and put the layers' states side by side: (1, S, 3*H)
per prompt, padding included, as diffusers feeds them. dev is guidance-distilled and klein's
step-distilled checkpoints (model_index.json `is_distilled`) run no CFG; klein otherwise runs
CFG with a negative prompt ("" by default).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoTokenizer, BatchEncoding, PreTrainedTokenizerBase

from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipeline import encode_with_negatives
from omnistage.models.text_encoders import QwenTextEncoder

DEFAULT_GUIDANCE = 4.0              # diffusers' default for both pipelines
MAX_SEQUENCE_LENGTH = 512           # text tokens, diffusers' default
# Flux2Pipeline's (from BFL's system_messages.py), line break included
SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured "
                  "responses focusing on object relationships, object\nattribution and actions "
                  "without speculation.")


def is_distilled(path: Path) -> bool:
    """model_index.json's `is_distilled` (klein's step-distilled checkpoints: no CFG)."""
    return bool(json.loads((Path(path) / "model_index.json").read_text()).get("is_distilled"))


def has_cfg(params: DiffusionParams, distilled: bool) -> bool:
    """diffusers' `do_classifier_free_guidance`: guidance_scale > 1 on a non-distilled klein."""
    return params.guidance(DEFAULT_GUIDANCE) > 1 and not distilled


def check_text_params(prompt: str | None, params: DiffusionParams, distilled: bool) -> None:
    """The request's text and guidance fields (prompt None: encoded upstream, not checked)."""
    if prompt is not None and not prompt.strip():
        raise ValueError("prompt: must be non-empty")
    if params.true_cfg_scale != 1.0:
        raise ValueError("true_cfg_scale: FLUX.2 has no separate true CFG; use guidance_scale")
    if params.negative_prompt is not None and not has_cfg(params, distilled):
        raise ValueError("negative_prompt: has no effect without CFG (FLUX.2-dev and "
                         "step-distilled klein run none; klein needs guidance_scale > 1)")
    if params.strength is not None:
        raise ValueError("strength: FLUX.2 edits from reference images, which are not noised; "
                         "strength does not apply")


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The folder's tokenizer. FLUX.2-dev ships a Pixtral processor there: its tokenizer, with
    the processor's chat template when the tokenizer has none (text-only prompts need no
    image processor)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.chat_template is None:
        if (folder / "chat_template.jinja").is_file():
            tokenizer.chat_template = (folder / "chat_template.jinja").read_text()
        elif (folder / "chat_template.json").is_file():
            tokenizer.chat_template = json.loads(
                (folder / "chat_template.json").read_text())["chat_template"]
    return tokenizer


class Flux2PromptEncoder:
    """FLUX.2-dev's: Mistral-3 over the system message and prompt, batched over requests."""

    layers: tuple[int, ...] = (10, 20, 30)
    guidance_distilled = True       # dev: never a CFG branch

    def __init__(self, text_encoder: QwenTextEncoder, tokenizer, device: torch.device,
                 is_distilled: bool, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> None:
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length={max_sequence_length}: must be >= 1")
        self.text_encoder = text_encoder.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.is_distilled = is_distilled
        self.max_sequence_length = max_sequence_length

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device,
                        dtype: torch.dtype | None) -> Flux2PromptEncoder:
        """The pipeline folder's text_encoder/ (run as an encoder; in `dtype`, None: its own)
        and tokenizer/."""
        path = Path(path)
        text_encoder = QwenTextEncoder.from_pretrained(path / "text_encoder", device, dtype)
        return cls(text_encoder, load_tokenizer(path / "tokenizer"), device,
                   cls.guidance_distilled or is_distilled(path))

    def validate(self, prompt: str, params: DiffusionParams) -> None:
        check_text_params(prompt, params, self.is_distilled)

    def encode(self, prompts: list[str], params: list[DiffusionParams]
               ) -> list[dict[str, Tensor]]:
        """Per request: prompt_embeds (1, S, 3*hidden), and negative_prompt_embeds with CFG."""
        return encode_with_negatives(self.encode_texts, prompts, params,
                                     lambda p: has_cfg(p, self.is_distilled))

    def tokenize(self, texts: list[str]) -> BatchEncoding:
        """`format_input` + the chat template, padded (Flux2Pipeline; "[IMG]" is dropped from
        prompts, as there)."""
        chats = [[{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
                  {"role": "user", "content": [{"type": "text",
                                                "text": t.replace("[IMG]", "")}]}]
                 for t in texts]
        return self.tokenizer.apply_chat_template(
            chats, add_generation_prompt=False, tokenize=True, return_dict=True,
            return_tensors="pt", padding="max_length", truncation=True,
            max_length=self.max_sequence_length)

    @torch.inference_mode()
    def encode_texts(self, texts: list[str]) -> list[Tensor]:
        """-> per text (1, S, len(layers) * hidden): the layers' states side by side."""
        inputs = self.tokenize(texts)
        states = self.text_encoder(inputs["input_ids"].to(self.device),
                                   inputs["attention_mask"].to(self.device),
                                   output_layers=self.layers)               # {layer: (B, S, H)}
        embeds = torch.cat([states[k] for k in self.layers], dim=-1)       # (B, S, 3H)
        return [e[None] for e in embeds]


class Flux2KleinPromptEncoder(Flux2PromptEncoder):
    """FLUX.2 [klein]'s: Qwen3 over the prompt."""

    layers = (9, 18, 27)
    guidance_distilled = False      # CFG unless model_index.json says step-distilled

    def tokenize(self, texts: list[str]) -> BatchEncoding:
        chats = [self.tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True,
            enable_thinking=False) for t in texts]
        return self.tokenizer(chats, padding="max_length", max_length=self.max_sequence_length,
                              truncation=True, return_tensors="pt")
