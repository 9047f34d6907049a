"""MiMo-Audio speaking in a given voice: upstream's prompt layouts that carry a reference clip
or a style instruction (XiaomiMiMo/MiMo-Audio src/mimo_audio/mimo_audio.py @691ce54). Segments
are tokenized one by one as in prompt.py; CLIP marks the reference clip's segment, laid out as
a user turn's audio is (<|sosp|> | one <|empty|> per speech patch | <|eosp|>, the patches' audio
ids the audio tokenizer's encoding of the clip, padded to whole patches).

    text to speech in the clip's voice (get_tts_sft_prompt with prompt_speech, L387-420: the
    read_text_only=False branch; upstream ignores prompt_speech without an instruction when it
    reads the text through its template, L429-441):
        <|im_start|>system\\n | CLONE_SYSTEM | CLIP | <|im_end|>\\n |
        <|im_start|>user\\n{text}<|im_end|>\\n | <|im_start|>assistant\\n<think>\\n
    ... with an instruction (L471-504):
        <|im_start|>system\\n | CLONE_SYSTEM | CLIP | <|im_end|>\\n |
        <|im_start|>user\\n{template}: {text}({instruction})<|im_end|>\\n |
        <|im_start|>assistant\\n<think>\\n
    an instruction, the model's own voice (L442-470):
        <|im_start|>system\\n | INSTRUCT_SYSTEM | <|im_end|>\\n | the user turn above |
        <|im_start|>assistant\\n<think>\\n
    chat answered in speech, in the clip's voice (get_spoken_dialogue_sft_multiturn_prompt,
    L675-697): before the turns
        <|im_start|>system\\n | Your voice should be: | CLIP | <|im_end|>\\n
    (the turns and <|im_start|>assistant\\n<|sostm|> as without a voice)

{text} is upstream's preprocess_input of the text (capitalised when all lower or upper case),
{template} the language's first TTS template (prompt.py). After <think>\\n the model writes its
thoughts, then speaks after <|sostm|> (speech.py takes the span after it)."""

from __future__ import annotations

import re
from typing import Any

from omnistage.models.mimo_audio.prompt import TTS_TEMPLATE, SpecialIds, segment_ids

CLONE_SYSTEM = "你需要根据指定的风格指令和文本内容来生成和语音prompt具有相同音色的语音。你的音色应该是："
INSTRUCT_SYSTEM = "你需要根据指定的风格指令和文本内容来生成语音。"
DIALOGUE_VOICE = "Your voice should be:"
THINK_START = "<|im_start|>assistant\n<think>\n"
CLIP = None                     # the reference clip's place in a list of segments
Segments = list[str | None]

_TTS_TURN = re.compile("<\\|im_start\\|>user\n(?:" + "|".join(map(re.escape, TTS_TEMPLATE.values()))
                       + "): (.*)<\\|im_end\\|>\n", re.DOTALL)


def tts_text(prompt: str | None) -> str | None:
    """The text a processed text-to-speech prompt speaks (prompt.py's user turn, its text as
    preprocess_input left it), or None for any other prompt (chat messages)."""
    found = _TTS_TURN.fullmatch(prompt or "")
    return None if found is None else found.group(1)


def tts_segments(text: str, instruction: str | None, has_clip: bool) -> Segments:
    """The whole prompt (answer's start included) of text to speech with a clip and/or an
    instruction (the module docstring's first three layouts)."""
    assert instruction or has_clip, "the plain layout is prompt.py's"
    if instruction:
        lang = "zh" if re.search(r"[\u4e00-\u9fff]", text) else "en"
        user = f"<|im_start|>user\n{TTS_TEMPLATE[lang]}: {text}({instruction})<|im_end|>\n"
    else:
        user = f"<|im_start|>user\n{text}<|im_end|>\n"
    system = [CLONE_SYSTEM, CLIP] if has_clip else [INSTRUCT_SYSTEM]
    return ["<|im_start|>system\n", *system, "<|im_end|>\n", user, THINK_START]


def dialogue_segments() -> Segments:
    """What goes before a spoken chat's turns for it to answer in the clip's voice."""
    return ["<|im_start|>system\n", DIALOGUE_VOICE, CLIP, "<|im_end|>\n"]


def layout_ids(tokenizer: Any, special: SpecialIds, segments: Segments,
               num_clip_patches: int) -> tuple[list[int], int | None]:
    """Segments -> text ids (the clip: <|sosp|>, an <|empty|> per patch, <|eosp|>) and where
    the clip's first patch is (None: no clip)."""
    ids: list[int] = []
    clip_idx = None
    for seg in segments:
        if seg is CLIP:
            clip_idx = len(ids) + 1
            ids += [special.sosp, *[special.empty] * num_clip_patches, special.eosp]
        else:
            ids += segment_ids(tokenizer, [seg])
    return ids, clip_idx
