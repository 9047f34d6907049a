"""The smallest reader of Mistral's `tekken.json` that Voxtral-TTS needs: the text's ids
(mistral-common's `Tekkenizer.encode(text, bos=False, eos=False)`: tiktoken's byte-level BPE
over the file's split pattern, each rank + the special-token count) and the speech prompt of
`InstructTokenizerV7.encode_speech_request(SpeechRequest(input, voice))`:

    [<s>] [BEGIN_AUDIO] [AUDIO] x n(voice) [NEXT_AUDIO_TEXT] text [REPEAT_AUDIO_TEXT] [BEGIN_AUDIO]

n(voice) is `audio.voice_num_audio_tokens[voice]` (the preset voice's frames). mistral-common
itself is not used: its release pins numpy below the one we run (golden against it instead:
tests/golden/models/test_voxtral_tts_tekken.py)."""

from __future__ import annotations

import base64
import json
from functools import lru_cache
from pathlib import Path

import regex

SPEECH_SPECIALS = ("<s>", "[BEGIN_AUDIO]", "[AUDIO]", "[NEXT_AUDIO_TEXT]", "[REPEAT_AUDIO_TEXT]")


class Tekken:
    def __init__(self, data: dict) -> None:
        cfg = data["config"]
        self.num_special = int(cfg["default_num_special_tokens"])
        inner = int(cfg["default_vocab_size"]) - self.num_special
        self.ranks = {base64.b64decode(t["token_bytes"]): t["rank"]
                      for t in data["vocab"][:inner]}
        self.pattern = regex.compile(cfg["pattern"])
        self.special = {t["token_str"]: t["rank"] for t in data.get("special_tokens") or ()}
        missing = [s for s in SPEECH_SPECIALS if s not in self.special]
        if missing:
            raise ValueError(f"tekken.json: no special token {', '.join(missing)}")
        audio = data.get("audio") or {}
        self.voice_frames: dict[str, int] = dict(audio.get("voice_num_audio_tokens") or {})
        self._bpe = lru_cache(maxsize=65536)(self._merge)

    @classmethod
    def from_file(cls, path: str | Path) -> Tekken:
        return cls(json.loads(Path(path).read_text()))

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self.pattern.findall(text):
            out += [r + self.num_special for r in self._bpe(piece.encode("utf-8"))]
        return out

    def _merge(self, piece: bytes) -> tuple[int, ...]:
        """tiktoken's byte_pair_merge: a piece in the vocabulary is one token; else merge the
        adjacent pair of the lowest rank (the leftmost of equals) until none is left."""
        if piece in self.ranks:
            return (self.ranks[piece],)
        parts = [piece[i:i + 1] for i in range(len(piece))]
        while len(parts) > 1:
            best, at = None, -1
            for i in range(len(parts) - 1):
                r = self.ranks.get(parts[i] + parts[i + 1])
                if r is not None and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        return tuple(self.ranks[p] for p in parts)

    def speech_prompt(self, text: str, voice: str) -> list[int]:
        """encode_speech_request's ids for a preset voice (KeyError naming it if unknown)."""
        if voice not in self.voice_frames:
            raise KeyError(f"voice {voice!r}: not in tekken.json's voices "
                           f"({', '.join(self.voice_frames) or 'none'})")
        s = self.special
        return [s["<s>"], s["[BEGIN_AUDIO]"], *[s["[AUDIO]"]] * self.voice_frames[voice],
                s["[NEXT_AUDIO_TEXT]"], *self.encode(text), s["[REPEAT_AUDIO_TEXT]"],
                s["[BEGIN_AUDIO]"]]
