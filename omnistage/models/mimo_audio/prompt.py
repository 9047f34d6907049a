"""MiMo-Audio's prompts as upstream builds them (XiaomiMiMo/MiMo-Audio src/mimo_audio/
mimo_audio.py @691ce54): a list of text segments, each tokenized on its own without special
tokens added, one LLM position (a patch) per text id, its audio ids all empty
(process_speechdata.py InputSegment.to_input_id).

    chat (get_text_dialogue_sft_multiturn_prompt; a system message goes into the first user
    turn followed by "\\n\\n", as get_spoken_dialogue_sft_multiturn_prompt puts it):
        <|im_start|>user\\n | {content} | <|im_end|>\\n | ... | <|im_start|>assistant\\n
    text to speech (get_tts_sft_prompt, read_text_only, no instruction):
        <|im_start|>user\\n{template}: {text}<|im_end|>\\n | <|im_start|>assistant\\n
    the answer's start, by what is asked for:
        speech:  <|sostm|>  (the reply spoken, its text interleaved; stops at <|eostm|>)
        text:    <think>\\n\\n</think>\\n  (thinking off, upstream's default)

Upstream draws the TTS template at random among a few phrasings; here it is the first of the
language's list (Chinese when the text has a CJK ideograph, as upstream's detect_language).
Speech in (audio segments: the audio tokenizer's encoder) is not ported: an audio part is
refused."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from omnistage.models.mimo_audio.config import MiMoAudioConfig

TTS_TEMPLATE = {"en": "Please convert this text to speech", "zh": "请将这段文字转换为语音"}
SPEECH_START = ("<|im_start|>assistant\n<|sostm|>",)
TEXT_START = ("<|im_start|>assistant\n", "<think>\n\n</think>\n")
SPECIAL = ("<|empty|>", "<|sostm|>", "<|eostm|>", "<|sosp|>", "<|eosp|>", "<|im_end|>")


def tts_user_text(text: str) -> str:
    """What upstream's TTS prompt asks in its user turn (preprocess_input's capitalising of an
    all-lower or all-upper text included)."""
    if text.isupper() or text.islower():
        text = text.capitalize()
    lang = "zh" if re.search(r"[\u4e00-\u9fff]", text) else "en"
    return f"{TTS_TEMPLATE[lang]}: {text}"


def chat_segments(messages: list[dict[str, Any]]) -> list[str]:
    """Chat messages (content a string, or text parts) -> upstream's text segments up to the
    assistant's turn (its start is the stage's: speech or text)."""
    system = "\n".join(_text(m, i) for i, m in enumerate(messages) if m.get("role") == "system")
    turns = [(i, m) for i, m in enumerate(messages) if m.get("role") != "system"]
    segs: list[str] = []
    first_user = True
    for i, m in turns:
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise ValueError(f"messages[{i}].role: {role!r}; MiMo-Audio takes system, user "
                             "and assistant")
        segs.append(f"<|im_start|>{role}\n")
        if role == "user" and first_user and system:
            segs += [system, "\n\n"]
        first_user = first_user and role != "user"
        segs += [_text(m, i), "<|im_end|>\n"]
    if not turns or turns[-1][1].get("role") != "user":
        raise ValueError("messages: the last message is the user's (MiMo-Audio answers it)")
    return segs


def _text(message: dict[str, Any], i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content or []):
        kind = part.get("type")
        if kind != "text":
            raise ValueError(f"messages[{i}].content[{j}]: MiMo-Audio takes text parts only "
                             f"here, not {kind} (speech input needs the audio tokenizer's "
                             "encoder: not ported yet)")
        out.append(part["text"])
    return "".join(out)


@dataclass(frozen=True, slots=True)
class SpecialIds:
    empty: int
    sostm: int
    eostm: int
    im_end: int

    @classmethod
    def of(cls, tokenizer: Any) -> SpecialIds:
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
        missing = [t for t, i in ids.items() if i is None or i == tokenizer.unk_token_id]
        if missing:
            raise ValueError(f"the tokenizer has no {', '.join(missing)} (not a MiMo-Audio one)")
        return cls(ids["<|empty|>"], ids["<|sostm|>"], ids["<|eostm|>"], ids["<|im_end|>"])


def segment_ids(tokenizer: Any, segments: list[str]) -> list[int]:
    """Each segment tokenized alone (no special tokens added), concatenated."""
    return [t for s in segments if s
            for t in tokenizer(s, add_special_tokens=False)["input_ids"]]


def text_patches(ids: list[int], cfg: MiMoAudioConfig) -> Tensor:
    """Text ids -> patches (T, group_size, 1 + channels): the id, all audio ids empty (our
    patch_embeds reads a text patch's frame 0 only; upstream's other frames hold -100)."""
    g, c = cfg.group_size, cfg.audio_channels
    out = torch.tensor(cfg.empty_ids, dtype=torch.long).repeat(len(ids), g, 1)
    return torch.cat([torch.tensor(ids, dtype=torch.long)[:, None, None].expand(-1, g, 1),
                      out.view(len(ids), g, c)], dim=2)


@dataclass(slots=True)
class MiMoAudioInputs:
    """What the front door reads of a processed prompt (engine/inputs.py
    parse_with_processor): the ids up to the assistant's turn; no media."""
    prompt: str
    input_ids: Tensor
    input_features: None = None
    audio_feature_lens: None = None
    pixel_values: None = None
    image_grid_thw: None = None
    pixel_values_videos: None = None
    video_grid_thw: None = None
    video_second_per_grid: None = None


class MiMoAudioInputProcessor:
    """The family's input processor: {"messages": [...]} -> upstream's chat segments; a plain
    string is text to speak (upstream's TTS user turn; what /v1/audio/speech sends)."""

    input_modalities = ("text",)

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, path: str | Path) -> MiMoAudioInputProcessor:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)))

    def parse_request(self, prompt: str | dict[str, Any]) -> MiMoAudioInputs:
        if isinstance(prompt, str):
            segs = [f"<|im_start|>user\n{tts_user_text(prompt)}<|im_end|>\n"]
        elif isinstance(prompt, dict) and set(prompt) == {"messages"}:
            segs = chat_segments(prompt["messages"])
        else:
            raise ValueError("prompt: MiMo-Audio takes messages, or a string to speak")
        return MiMoAudioInputs("".join(segs), torch.tensor(segment_ids(self.tokenizer, segs)))
