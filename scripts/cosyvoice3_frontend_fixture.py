"""Regenerate tests/fixtures/cosyvoice3/frontend.pt: the upstream CosyVoice3 front end's
feature extraction on a real-length clip (FunAudioLLM/CosyVoice cosyvoice/cli/frontend.py at
ace7c47: `_extract_speech_token` feeds `whisper.log_mel_spectrogram(speech, n_mels=128)` to
speech_tokenizer_v3.onnx, `_extract_spk_embedding` feeds `kaldi.fbank(speech, num_mel_bins=80,
dither=0, sample_frequency=16000)` minus its mean over time to campplus.onnx).

    python scripts/cosyvoice3_frontend_fixture.py [--out tests/fixtures/cosyvoice3/frontend.pt]

Runs in the reference's environment (openai-whisper 20250625, torchaudio 2.11.1). torchaudio's
compliance/kaldi.py is loaded as a file with a stub `torchaudio` module (it only imports the
package name; the wheel's C extension need not load). The clip: 2.7 s at 16 kHz, a voiced
harmonic tone with a moving pitch and syllable-like envelope plus noise (seed 7), rounded to
int16 as a decoded file would be; saved as int16 with the features."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import types

import torch


def _kaldi():
    sys.modules.setdefault("torchaudio", types.ModuleType("torchaudio"))
    import site
    for d in site.getsitepackages():
        path = f"{d}/torchaudio/compliance/kaldi.py"
        try:
            spec = importlib.util.spec_from_file_location("kaldi_ref", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
        except FileNotFoundError:
            continue
    raise SystemExit("torchaudio/compliance/kaldi.py not found")


def clip(seconds: float = 2.7, sr: int = 16000) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    t = torch.arange(int(seconds * sr), dtype=torch.float64) / sr
    f0 = 140 + 40 * torch.sin(2 * math.pi * 0.7 * t)
    phase = 2 * math.pi * torch.cumsum(f0, 0) / sr
    voiced = sum(torch.sin(k * phase) / k for k in range(1, 12))
    env = torch.sin(math.pi * 3.3 * t).abs() ** 0.5
    x = 0.25 * env * voiced + 0.01 * torch.randn(t.shape, generator=g, dtype=torch.float64)
    return (x.clamp(-1, 1) * 32767).round().to(torch.int16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/cosyvoice3/frontend.pt")
    args = ap.parse_args()
    import whisper
    kaldi = _kaldi()
    pcm = clip()
    speech = (pcm.float() / 32768.0)[None]                        # load_wav: (1, N) in [-1, 1]
    mel = whisper.log_mel_spectrogram(speech, n_mels=128)         # (1, 128, T)
    fbank = kaldi.fbank(speech, num_mel_bins=80, dither=0, sample_frequency=16000)
    fbank = fbank - fbank.mean(dim=0, keepdim=True)               # (T', 80)
    torch.save({"pcm16k": pcm, "log_mel": mel.contiguous(), "fbank": fbank.contiguous()}, args.out)
    print(args.out, tuple(mel.shape), tuple(fbank.shape), float(mel.abs().mean()), float(fbank.abs().mean()))


if __name__ == "__main__":
    main()
