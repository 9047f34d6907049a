"""Golden fixture for MiMo-Audio's speech input: upstream's `MimoAudio.preprocess_input` (a
waveform -> log-mel -> the audio tokenizer's encoder in 6000-frame segments -> RVQ codes, the
first `audio_channels`, padded to whole patches) and `get_audio_understanding_sft_prompt` (the
audio between <|sosp|> and <|eosp|> in the user turn), on the tiny tokenizer of
tests/fixtures/mimo_audio/tokenizer (from scripts/mimo_audio_tokenizer_fixtures.py).

Run with the reference's own environment (transformers==4.49.0 and torchaudio 2.11.1
installed with --no-deps, its C extension moved out of torchaudio/lib: torch 2.13 cannot load
it, and MelSpectrogram is plain torch), never omnistage's .venv:

    .venv/bin/python -c "from tests.helpers.mimo_audio import build_tiny_text_tokenizer; \\
        build_tiny_text_tokenizer('/tmp/mimo_tok')"
    /work/ref-mimo/venv/bin/python scripts/mimo_audio_encoder_fixtures.py \\
        /path/to/MiMo-Audio-checkout /tmp/mimo_tok

Upstream's methods run unbound on a stand-in `self` holding the tiny tokenizers and upstream's
fields (no LLM is loaded; the mel transform is built as upstream's __init__ builds it);
flash-attn is the SDPA stand-in of scripts/mimo_audio_tokenizer_fixtures.py. Written:
tests/fixtures/mimo_audio/encode.safetensors (the waveforms, the short one's log-mel, each
waveform's audio ids and the prompt's ids) with the commit in its metadata.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mimo_audio_tokenizer_fixtures import OUT, varlen_sdpa  # noqa: E402

SEGMENT = 6000          # upstream's segment_size (mel frames)


def load_upstream(repo: Path) -> types.ModuleType:
    import transformers  # noqa: F401  (its package checks run before the stubs exist)
    import transformers.modeling_utils  # noqa: F401

    fa = types.ModuleType("flash_attn")
    fa.flash_attn_varlen_func = varlen_sdpa
    sys.modules["flash_attn"] = fa
    sys.modules["soundfile"] = types.ModuleType("soundfile")
    sys.path.insert(0, str(repo))
    return importlib.import_module("src.mimo_audio.mimo_audio")


def main() -> None:
    repo, tok_dir = Path(sys.argv[1]), sys.argv[2]
    commit = subprocess.check_output(["git", "-C", str(repo), "rev-parse", "HEAD"],
                                     text=True).strip()
    up = load_upstream(repo)
    from tokenizers import Tokenizer
    from torchaudio.transforms import MelSpectrogram
    from transformers import PreTrainedTokenizerFast

    audio_tok = importlib.import_module("src.mimo_audio_tokenizer").MiMoAudioTokenizer
    codec = audio_tok.from_pretrained(str(OUT / "tokenizer")).eval()
    c = codec.config
    me = types.SimpleNamespace(
        tokenizer=PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(
            f"{tok_dir}/tokenizer.json")), group_size=4, audio_channels=8,
        speech_zeroemb_idx=[32, 32, 16, 16, 16, 16, 16, 16], device="cpu",
        mimo_audio_tokenizer=codec,
        mel_transform=MelSpectrogram(sample_rate=c.sampling_rate, n_fft=c.nfft,
                                     hop_length=c.hop_length, win_length=c.window_size,
                                     f_min=c.fmin, f_max=c.fmax, n_mels=c.n_mels, power=1.0,
                                     center=True))
    me.empty_token = me.tokenizer.convert_tokens_to_ids("<|empty|>")
    for name in ("preprocess_input", "get_input_ids", "wav2mel", "encode_batch",
                 "group_by_length"):
        setattr(me, name, types.MethodType(getattr(up.MimoAudio, name), me))

    gen = torch.Generator().manual_seed(5)
    # 337 samples: 85 mel frames, 43 rows after conv2 (an odd count: the pooled group at the
    # end is half padding), 22 ids padded to 24 (whole patches); the long one 6253 mel
    # frames: two segments in one padded batch (6000 and 253 frames; the short one's odd
    # last group filled as upstream's unpacking fills it)
    short = torch.randn(337, generator=gen) * 0.3
    long = torch.randn(SEGMENT * c.hop_length + 1008, generator=gen) * 0.3
    out = {"wav_short": short, "wav_long": long, "mel_short": me.wav2mel(short).T.contiguous()}
    with torch.no_grad():
        for name, wav in (("short", short), ("long", long)):
            out[f"ids_{name}"] = up.MimoAudio.preprocess_input(me, wav).long()
        prompt = up.MimoAudio.get_audio_understanding_sft_prompt(me, short, "Describe it.")
    out["prompt"] = prompt.long().contiguous()
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in out.items()}, str(OUT / "encode.safetensors"),
              metadata={"commit": commit, "text": "Describe it."})
    print(commit, {k: tuple(v.shape) for k, v in out.items()})


if __name__ == "__main__":
    main()
