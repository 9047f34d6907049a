"""Writes tests/fixtures/voxtral_tts/tekken/: a tiny tekken.json in the release's format (the
Tekken v7 pattern, 256 byte tokens + a few merges, 40 special tokens with the speech ones at the
release's ids, an `audio` block with preset voices) and expected.json: the prompt ids
mistral-common's `encode_speech_request(SpeechRequest(input, voice))` gives for a few texts.
Run in the reference env (mistral-common installed):

    /work/ref-voxtral/bin/python scripts/voxtral_tts_tekken.py
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from mistral_common.protocol.speech.request import SpeechRequest
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "voxtral_tts" / "tekken"
PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
           r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
           r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
NAMED = dict(enumerate(["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                        "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                        "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]",
                        "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                        "[TOOL_CONTENT]"]))
NAMED.update({24: "[AUDIO]", 25: "[BEGIN_AUDIO]", 34: "[TRANSCRIBE]", 35: "[REPEAT_AUDIO_TEXT]",
              36: "[NEXT_AUDIO_TEXT]"})
N_SPECIAL = 40
MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"er", b"is", b" i", b" is",
          b"an", b"on", b"ll", b"lo", b"llo", b"el", b"hel", b"hello", b"or", b"wor", b"ld",
          b"world", b"at", "é".encode()]
VOICES = {"neutral_female": 3, "casual_male": 5}
TEXTS = ["Hello world, this is the thing!", "Él is 42 años  older\nthan   that.", "é",
         "The THE tHe ñandú 3.14"]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    vocab = [bytes([i]) for i in range(256)] + MERGES
    tekken = {
        "config": {"pattern": PATTERN, "num_vocab_tokens": len(vocab),
                   "default_vocab_size": N_SPECIAL + len(vocab),
                   "default_num_special_tokens": N_SPECIAL, "version": "v7"},
        "vocab": [{"rank": i, "token_bytes": base64.b64encode(b).decode(),
                   "token_str": b.decode("utf-8", "replace")} for i, b in enumerate(vocab)],
        "special_tokens": [{"rank": i, "token_str": NAMED.get(i, f"<SPECIAL_{i}>"),
                            "is_control": True} for i in range(N_SPECIAL)],
        "audio": {"sampling_rate": 24000, "frame_rate": 12.5,
                  "audio_encoding_config": {"num_mel_bins": 128, "hop_length": 160,
                                            "window_size": 400},
                  "voice_num_audio_tokens": VOICES},
    }
    (OUT / "tekken.json").write_text(json.dumps(tekken, indent=1))
    tok = MistralTokenizer.from_file(str(OUT / "tekken.json")).instruct_tokenizer
    expected = [{"input": t, "voice": v,
                 "ids": tok.encode_speech_request(SpeechRequest(input=t, voice=v)).tokens}
                for t in TEXTS for v in VOICES]
    (OUT / "expected.json").write_text(json.dumps(expected))
    print(expected[0])


if __name__ == "__main__":
    main()
