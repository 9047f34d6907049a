"""A VibeVoice script ("Speaker 1: ...", "Speaker 2: ..." lines) as the LM's prompt ids, laid
out as Microsoft's VibeVoice processor writes it:

     Transform the text provided by various speakers into speech output, ...\\n
     Voice input:\\n                                  (only when the speakers have voice clips)
     Speaker 0:<audio_bos><audio> x frames<audio_eos>\\n     one line per speaker
     Text input:\\n
     Speaker 0: Hello there.\\n                       one line per script line
     Speech output:\\n<audio_bos>

Speaker numbers are renumbered from 0 in the order of their first line (the processor
subtracts the smallest); a text without any "Speaker N:" line is one line of speaker 0, and a
line without a label continues the line before it. The `audio` placeholder ids are replaced by
each clip's latent frames in `prompt.prompt_embeds`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from omnistage.models.vibevoice.config import SpeechTokenIds

SYSTEM = (" Transform the text provided by various speakers into speech output, utilizing the "
          "distinct voice of each respective speaker.\n")
LABEL = re.compile(r"^\s*speaker\s*(\d+)\s*:(.*)$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Script:
    """Lines (speaker index from 0, text) and the number of speakers."""
    lines: tuple[tuple[int, str], ...]
    num_speakers: int


def parse_script(text: str) -> Script:
    """ValueError for a script with no words."""
    lines: list[list] = []
    order: dict[str, int] = {}
    for raw in text.splitlines():
        m = LABEL.match(raw)
        if m:
            speaker = order.setdefault(m.group(1).lstrip("0") or "0", len(order))
            lines.append([speaker, m.group(2).strip()])
        elif raw.strip():
            if lines:
                lines[-1][1] = f"{lines[-1][1]} {raw.strip()}".strip()
            else:
                order.setdefault("0", 0)
                lines.append([0, raw.strip()])
    lines = [ln for ln in lines if ln[1]]
    if not lines:
        raise ValueError("the script has no words to speak")
    return Script(tuple((s, t) for s, t in lines), max(order.values()) + 1)


def script_ids(encode: Callable[[str], list[int]], tokens: SpeechTokenIds, script: Script,
               clip_frames: Sequence[int] | None) -> list[int]:
    """The prompt's ids; clip_frames: each speaker's clip length in latent frames (None: no
    voice section). Ends with audio_bos, where the speech starts."""
    if clip_frames is not None and len(clip_frames) != script.num_speakers:
        raise ValueError(f"{len(clip_frames)} voice clips for {script.num_speakers} speakers")
    ids = list(encode(SYSTEM))
    if clip_frames is not None:
        ids += encode(" Voice input:\n")
        for speaker, n in enumerate(clip_frames):
            ids += encode(f" Speaker {speaker}:")
            ids += [tokens.audio_bos] + [tokens.audio] * n + [tokens.audio_eos]
            ids += encode("\n")
    ids += encode(" Text input:\n")
    for speaker, line in script.lines:
        ids += encode(f" Speaker {speaker}: {line}\n")
    ids += encode(" Speech output:\n")
    return ids + [tokens.audio_bos]
