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

    speech in (get_audio_understanding_sft_prompt's layout): a user turn's audio part is a
        segment of its own, <|sosp|> | one <|empty|> per speech patch | <|eosp|>, the patches'
        audio ids the audio tokenizer's encoding of it (models/mimo_audio/tokenizer_encoder.py,
        run by the LLM stage)

Upstream draws the TTS template at random among a few phrasings; here it is the first of the
language's list (Chinese when the text has a CJK ideograph, as upstream's detect_language)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from omnistage.models.audio_parts import part_waveform
from omnistage.models.mimo_audio.config import MiMoAudioConfig
from omnistage.models.mimo_audio.tokenizer_decoder import tokenizer_config
from omnistage.models.mimo_audio.tokenizer_encoder import num_speech_frames

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


Hear = Callable[[dict[str, Any], str], np.ndarray]     # an audio part -> its waveform


def chat_segments(messages: list[dict[str, Any]], hear: Hear | None = None
                  ) -> list[str | np.ndarray]:
    """Chat messages (content a string, or text and audio parts) -> upstream's segments up to
    the assistant's turn (its start is the stage's: speech or text): text, and each audio
    part's waveform (`hear` makes it one; None: audio refused) where upstream puts an audio
    segment."""
    system = "\n".join(_text(m, i) for i, m in enumerate(messages) if m.get("role") == "system")
    turns = [(i, m) for i, m in enumerate(messages) if m.get("role") != "system"]
    segs: list[str | np.ndarray] = []
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
        segs += [*_content(m, i, hear if role == "user" else None), "<|im_end|>\n"]
    if not turns or turns[-1][1].get("role") != "user":
        raise ValueError("messages: the last message is the user's (MiMo-Audio answers it)")
    return segs


def _content(message: dict[str, Any], i: int, hear: Hear | None) -> list[str | np.ndarray]:
    """A message's segments: its text parts joined, an audio part a segment of its own."""
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    out: list[str | np.ndarray] = []
    for j, part in enumerate(content or []):
        kind = part.get("type")
        if kind == "audio" and hear is not None:
            out.append(hear(part, f"messages[{i}].content[{j}]"))
        elif kind == "text" and out and isinstance(out[-1], str):
            out[-1] += part["text"]
        elif kind == "text":
            out.append(part["text"])
        else:
            where = "here" if hear is None else "in a user turn"
            raise ValueError(f"messages[{i}].content[{j}]: MiMo-Audio takes text parts "
                             f"{where}, not {kind}" + (" (no audio_tokenizer/ in the model "
                                                       "folder)" if kind == "audio" else ""))
    return out or [""]


def _text(message: dict[str, Any], i: int) -> str:
    out = _content(message, i, None)
    return "".join(out)  # type: ignore[arg-type]  (text only without `hear`)


@dataclass(frozen=True, slots=True)
class SpecialIds:
    empty: int
    sostm: int
    eostm: int
    im_end: int
    sosp: int
    eosp: int

    @classmethod
    def of(cls, tokenizer: Any) -> SpecialIds:
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
        missing = [t for t, i in ids.items() if i is None or i == tokenizer.unk_token_id]
        if missing:
            raise ValueError(f"the tokenizer has no {', '.join(missing)} (not a MiMo-Audio one)")
        return cls(ids["<|empty|>"], ids["<|sostm|>"], ids["<|eostm|>"], ids["<|im_end|>"],
                   ids["<|sosp|>"], ids["<|eosp|>"])


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


def speech_patches(ids: Tensor, cfg: MiMoAudioConfig) -> Tensor:
    """Audio ids (T, channels), T whole patches -> patches (T / group_size, group_size,
    1 + channels): text <|empty|> (a speech position), the ids grouped."""
    g, c = cfg.group_size, cfg.audio_channels
    text = torch.full((ids.shape[0] // g, g, 1), cfg.empty_idx, dtype=torch.long)
    return torch.cat([text, ids.long().view(-1, g, c)], dim=2)


@dataclass(slots=True)
class MiMoAudioInputs:
    """What the front door reads of a processed prompt (engine/inputs.py
    parse_with_processor): the ids up to the assistant's turn and, for audio parts, their
    waveforms at the audio tokenizer's rate (one after another), their lengths and where each
    one's speech patches start in the prompt (the LLM stage encodes them there)."""
    prompt: str
    input_ids: Tensor
    audio_waveforms: Tensor | None = None
    audio_lens: Tensor | None = None
    audio_starts: Tensor | None = None
    positions: None = None          # 1-D positions: none for the front door to send


class MiMoAudioInputProcessor:
    """The family's input processor: {"messages": [...]} -> upstream's chat segments (audio
    parts of user turns: <|sosp|>, one <|empty|> per speech patch, <|eosp|>, the patch count
    known from the waveform's length); a plain string is text to speak (upstream's TTS user
    turn; what /v1/audio/speech sends). `speech`: the folder's audio_tokenizer/config.json
    (None: no audio input)."""

    def __init__(self, tokenizer: Any, speech: dict[str, Any] | None = None,
                 group_size: int = 4) -> None:
        self.tokenizer, self.speech, self.group_size = tokenizer, speech, group_size
        self.input_modalities = ("text", "audio") if speech is not None else ("text",)
        self.special = SpecialIds.of(tokenizer)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> MiMoAudioInputProcessor:
        from transformers import AutoTokenizer

        path = Path(path)
        speech = path / "audio_tokenizer" / "config.json"
        group = json.loads((path / "config.json").read_text()).get("group_size", 4)
        return cls(AutoTokenizer.from_pretrained(str(path)),
                   tokenizer_config(speech.parent) if speech.is_file() else None, int(group))

    def hear(self, part: dict[str, Any], where: str) -> np.ndarray:
        assert self.speech is not None
        return part_waveform(part, where, self.speech["sampling_rate"], self.speech["nfft"])

    def parse_request(self, prompt: str | dict[str, Any]) -> MiMoAudioInputs:
        if isinstance(prompt, str):
            segs: list[str | np.ndarray] = [
                f"<|im_start|>user\n{tts_user_text(prompt)}<|im_end|>\n"]
        elif isinstance(prompt, dict) and set(prompt) == {"messages"}:
            segs = chat_segments(prompt["messages"],
                                 self.hear if self.speech is not None else None)
        else:
            raise ValueError("prompt: MiMo-Audio takes messages, or a string to speak")
        ids: list[int] = []
        waves: list[np.ndarray] = []
        starts: list[int] = []
        for seg in segs:
            if isinstance(seg, str):
                ids += segment_ids(self.tokenizer, [seg])
                continue
            assert self.speech is not None
            frames = num_speech_frames(seg.shape[0], self.speech)
            starts.append(len(ids) + 1)
            ids += [self.special.sosp, *[self.special.empty] * -(-frames // self.group_size),
                    self.special.eosp]
            waves.append(seg)
        text = "".join(s if isinstance(s, str) else "<|sosp|>(audio)<|eosp|>" for s in segs)
        if not waves:
            return MiMoAudioInputs(text, torch.tensor(ids))
        return MiMoAudioInputs(text, torch.tensor(ids),
                               torch.from_numpy(np.concatenate(waves)).float(),
                               torch.tensor([w.shape[0] for w in waves]), torch.tensor(starts))
