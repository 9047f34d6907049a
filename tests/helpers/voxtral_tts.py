"""A tiny Voxtral-TTS folder as the release ships it (params.json, consolidated.safetensors,
tekken.json, voice_embedding/<name>.pt) from the golden fixtures (tests/fixtures/voxtral_tts/:
the head and codec of vLLM-Omni's classes, the tiny tekken.json of mistral-common) plus a random
2-layer backbone, and the golden path on it: the prompt from tekken.json, a loop without a KV
cache over the golden parts (the backbone golden vs transformers' Mistral, the head vs
vLLM-Omni), the codec decoder (golden vs vLLM-Omni)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "voxtral_tts"
VOCAB, DIM = 384, 32


def build_folder(out: Path, seed: int = 0) -> Path:
    """The tiny release-layout folder under `out` (no config.json)."""
    out.mkdir(parents=True, exist_ok=True)
    raw = load_file(FIXTURES / "tiny" / "consolidated.safetensors")
    g = torch.Generator().manual_seed(seed)
    raw["audio_tokenizer.output_proj.conv.parametrizations.weight.original0"] *= 0.03
    raw["mm_audio_embeddings.tok_embeddings.weight"] = torch.randn(VOCAB, DIM, generator=g)
    raw["norm.weight"] = 1 + 0.1 * torch.randn(DIM, generator=g)
    for i in range(2):
        for name, shape in [("attention.wq", (32, 32)), ("attention.wk", (16, 32)),
                            ("attention.wv", (16, 32)), ("attention.wo", (32, 32)),
                            ("feed_forward.w1", (48, 32)), ("feed_forward.w3", (48, 32)),
                            ("feed_forward.w2", (32, 48)), ("attention_norm", (32,)),
                            ("ffn_norm", (32,))]:
            w = torch.randn(shape, generator=g)
            raw[f"layers.{i}.{name}.weight"] = 1 + 0.1 * w if len(shape) == 1 else \
                w * 0.4 / shape[1] ** 0.5
    save_file(raw, out / "consolidated.safetensors")
    params = json.loads((FIXTURES / "tiny" / "params.json").read_text())
    params.update(n_layers=2, head_dim=8, hidden_dim=48, n_heads=4, n_kv_heads=2,
                  norm_eps=1e-5, vocab_size=VOCAB, rope_theta=1e6)
    (out / "params.json").write_text(json.dumps(params))
    shutil.copy(FIXTURES / "tekken" / "tekken.json", out / "tekken.json")
    voices = json.loads((out / "tekken.json").read_text())["audio"]["voice_num_audio_tokens"]
    (out / "voice_embedding").mkdir(exist_ok=True)
    for k, (name, n) in enumerate(voices.items()):
        rows = torch.randn(n, DIM, generator=torch.Generator().manual_seed(100 + k))
        torch.save(rows, out / "voice_embedding" / f"{name}.pt")
    return out


@torch.no_grad()
def golden_audio(folder: Path, text: str, voice: str, seed: int, alpha: float,
                 max_frames: int) -> tuple[torch.Tensor, int]:
    """(waveform of the frames before [END_AUDIO], at most `max_frames`; samples a frame)."""
    from omnistage.models.mimo_audio.model import dense_forward
    from omnistage.models.voxtral_tts.codec import VoxtralCodecDecoder
    from omnistage.models.voxtral_tts.model import VoxtralTTSForCausalLM
    from omnistage.models.voxtral_tts.tekken import Tekken

    model = VoxtralTTSForCausalLM.from_pretrained(folder)
    ids = torch.tensor(Tekken.from_file(folder / "tekken.json").speech_prompt(text, voice))
    rows = model.prompt_embeds(ids, torch.load(folder / "voice_embedding" / f"{voice}.pt"))
    gen, frames = torch.Generator().manual_seed(seed), []
    n = model.head.cfg.n_acoustic_codebook
    for _ in range(max_frames):
        h = dense_forward(model.model, rows[None])[0, -1:]
        frame = model.head(h, torch.tensor([alpha]), torch.randn(1, n, generator=gen))
        if frame[0, 0] == 1:
            break
        frames.append(frame[0])
        rows = torch.cat([rows, model.audio_embedding(frame)])
    codec = VoxtralCodecDecoder.from_pretrained(folder).float().eval()
    codes = (torch.stack(frames) - 2).T[None]
    return codec(codes).reshape(-1), codec.cfg.samples_per_frame
