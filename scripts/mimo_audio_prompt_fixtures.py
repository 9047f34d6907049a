"""Golden fixture for MiMo-Audio's prompts, from the upstream code (XiaomiMiMo/MiMo-Audio,
src/mimo_audio/mimo_audio.py, process_speechdata.py).

Run with the reference's own environment (transformers==4.49.0), never omnistage's .venv:

    .venv/bin/python -c "from tests.helpers.mimo_audio import build_tiny_text_tokenizer; \
        build_tiny_text_tokenizer('/tmp/mimo_tok')"
    /work/ref-mimo/venv/bin/python scripts/mimo_audio_prompt_fixtures.py \
        /path/to/MiMo-Audio-checkout /tmp/mimo_tok

Upstream's own prompt methods (`get_tts_sft_prompt`, `get_text_dialogue_sft_multiturn_prompt`)
run unbound on a stand-in `self` holding the tiny tokenizer and upstream's fields (no model is
loaded); the modules they import but these methods never call (torchaudio, soundfile, the audio
tokenizer) are stubs. `random.choice` (the TTS template) is pinned to the first choice, as our
prompt takes it. The tokenizer is read from its tokenizer.json (the folder's
tokenizer_config.json names transformers 5's class). Recorded: each prompt's text row, one id per patch (upstream's frame 0), into
tests/fixtures/mimo_audio/prompts.json.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import types
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "mimo_audio" / "prompts.json"
TTS = ["Hello world.", "hello there", "你好，世界。"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"},
          {"role": "user", "content": "Tell me a joke."}]]


def load_upstream(repo: Path) -> types.ModuleType:
    import transformers  # noqa: F401  (its package checks run before the stubs exist)

    for name in ("torchaudio", "torchaudio.transforms", "soundfile", "src.mimo_audio_tokenizer"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["torchaudio.transforms"].MelSpectrogram = object
    sys.modules["src.mimo_audio_tokenizer"].MiMoAudioTokenizer = object
    sys.path.insert(0, str(repo))
    return importlib.import_module("src.mimo_audio.mimo_audio")


def main() -> None:
    repo, tok_dir = Path(sys.argv[1]), sys.argv[2]
    commit = subprocess.check_output(["git", "-C", str(repo), "rev-parse", "HEAD"],
                                     text=True).strip()
    up = load_upstream(repo)
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    up.random.choice = lambda seq: seq[0]
    me = types.SimpleNamespace(
        tokenizer=PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(
            f"{tok_dir}/tokenizer.json")), group_size=4, audio_channels=8,
        speech_zeroemb_idx=[32, 32, 16, 16, 16, 16, 16, 16], device="cpu")
    me.empty_token = me.tokenizer.convert_tokens_to_ids("<|empty|>")
    for name in ("preprocess_input", "get_input_ids"):
        setattr(me, name, types.MethodType(getattr(up.MimoAudio, name), me))

    def text_row(ids) -> list[int]:          # (1 + C, T * G) -> frame 0 of each patch
        return ids[0, ::me.group_size].tolist()
    out = {"upstream": "XiaomiMiMo/MiMo-Audio", "commit": commit,
           "tts": [{"text": t, "ids": text_row(up.MimoAudio.get_tts_sft_prompt(me, t))}
                   for t in TTS],
           "text_chat": [{"messages": m, "ids": text_row(
               up.MimoAudio.get_text_dialogue_sft_multiturn_prompt(me, m))} for m in CHATS]}
    OUT.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
