"""Golden fixture for MiMo-Audio's audio tokenizer decoder (RVQ ids -> 24 kHz-style waveform)
from upstream XiaomiMiMo/MiMo-Audio (src/mimo_audio_tokenizer), run with upstream's pins:

    /work/ref-mimo/venv/bin/python scripts/mimo_audio_tokenizer_fixtures.py /path/to/checkout

A TINY seeded MiMoAudioTokenizer (random codebooks), saved with save_pretrained, and
`decode(codes)` of fixed codes. flash-attn is replaced by an SDPA function of the same
signature with the same window semantics (key j seen by query i iff i - left <= j <= i + right,
-1 = unbounded; causal sets right = 0)."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "mimo_audio"
TINY = dict(max_audio_seconds=2, stride_size=2, avg_pooler=2, d_model=32, kernel_size=3,
            encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
            decoder_layers=2, decoder_attention_heads=2, decoder_ffn_dim=64,
            decoder_kernel_size=3, decoder_stride_size=2, decoder_causal=True,
            decoder_attn_window_size=[3, 0], nfft=16, vocoder_dim=24,
            vocoder_intermediate_dim=48, vocoder_num_layers=2, n_mels=8, sampling_rate=400,
            hop_length=4, window_size=16, num_quantizers=8,
            codebook_size=[32, 32, 16, 16, 16, 16, 16, 16], vocoder_attention_heads=2,
            vocoder_attn_window_size=[4, 2], ln_type="LayerNorm")


def varlen_sdpa(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, window_size=(-1, -1)):
    out = torch.empty_like(q)
    left, right = window_size
    if causal:
        right = 0
    bounds = cu_q.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        n = e - s
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        ok = torch.ones(n, n, dtype=torch.bool)
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                           v[s:e].transpose(0, 1), attn_mask=ok)
        out[s:e] = o.transpose(0, 1)
    return out


def main() -> None:
    repo = Path(sys.argv[1])
    commit = subprocess.check_output(["git", "-C", str(repo), "rev-parse", "HEAD"],
                                     text=True).strip()
    import transformers.modeling_utils  # noqa: F401  (before the stand-in flash_attn exists)

    fa = types.ModuleType("flash_attn")
    fa.flash_attn_varlen_func = varlen_sdpa
    sys.modules["flash_attn"] = fa
    sys.path.insert(0, str(repo / "src"))
    from mimo_audio_tokenizer import MiMoAudioTokenizer, MiMoAudioTokenizerConfig

    torch.manual_seed(0)
    model = MiMoAudioTokenizer(MiMoAudioTokenizerConfig(**TINY)).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("_codebook.embed"):
                buf.copy_(torch.randn_like(buf))
    gen = torch.Generator().manual_seed(3)
    codes = torch.stack([torch.randint(0, n, (7,), generator=gen)
                         for n in TINY["codebook_size"]])                # (8, 7)
    wav = model.decode(codes)
    model.save_pretrained(OUT / "tokenizer", safe_serialization=True)
    from safetensors.torch import save_file
    save_file({"codes": codes.contiguous(), "wav": wav.float().contiguous()},
              str(OUT / "tokenizer_decode.safetensors"), metadata={"commit": commit})
    print(commit, tuple(wav.shape), float(wav.std()), float(wav.abs().max()))


if __name__ == "__main__":
    main()
