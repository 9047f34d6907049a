"""VibeVoice: our decoding loop (omnistage/models/vibevoice: `SpeechLoop` on our paged
attention) against transformers' `VibeVoiceForConditionalGeneration.generate`, on one random
checkpoint built in the run, both measured in the same call.

    transformers: one request at a time (its generate returns the waveform whole, so its first
                  audio is its end-to-end time); eager, float32 on the CPU, bfloat16 on CUDA
    ours:         `SpeechLoop` with omnistage.testing's `PagedLM` runner (the LM on our paged
                  attention; the AR engine does not serve VibeVoice yet): at concurrency c,
                  c requests added at once; first audio = start to the step that made the
                  request's first frame, end to end = start to its last step

Both sides make exactly `frames` speech steps per request: the checkpoint's LM head is set so
that greedy decoding always picks the audio token (`force_speech`). Headline fields:

    vibevoice_rtf_c1                    end-to-end seconds per second of audio, concurrency 1
    vibevoice_first_audio_s_c1          first audio at concurrency 1, seconds
    vibevoice_first_audio_c8_over_c1    first audio at 8 against at 1
    vibevoice_e2e_speedup_vs_reference  transformers' end to end over ours, concurrency 1

Shapes: "1.5b" is VibeVoice-1.5B's (Qwen2.5-1.5B LM, 4-layer head, the 3200-sample hop
tokenizers); "tiny" the golden tests' checkpoint (CPU, CI). Run:
`python -m omnistage.benchmarks.vibevoice [--tiny] [--frames N] [--concurrency 1,8]`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from omnistage.benchmarks.common import environment, free_device_memory, summary, write_result
from omnistage.models.vibevoice.generate import SpeechLoop, SpeechRequest
from omnistage.models.vibevoice.model import VibeVoiceForConditionalGeneration
from omnistage.utils.device import resolve_device

PROMPT_LEN = 48
SAMPLE_RATE = 24000


@dataclass(frozen=True, slots=True)
class VibeVoiceBenchConfig:
    tiny: bool = False
    frames: int | None = None                  # default 40 (5.3 s of audio); tiny 6
    concurrency: tuple[int, ...] = (1, 8)
    num_diffusion_steps: int = 10
    guidance_scale: float = 1.3
    reference_requests: int = 2                # 0: ours only
    device: str = "auto"
    seed: int = 0

    @property
    def num_frames(self) -> int:
        return self.frames or (6 if self.tiny else 40)


def build_checkpoint(root: Path, cfg: VibeVoiceBenchConfig) -> Path:
    if cfg.tiny:
        from omnistage.testing.tiny_vibevoice import build_tiny_vibevoice
        build_tiny_vibevoice(root, cfg.seed)
    else:
        from transformers import VibeVoiceConfig
        from transformers import VibeVoiceForConditionalGeneration as Reference

        text = dict(model_type="qwen2", vocab_size=151936, hidden_size=1536,
                    intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                    num_key_value_heads=2, max_position_embeddings=65536, rms_norm_eps=1e-6,
                    rope_theta=1e6, tie_word_embeddings=True)
        config = VibeVoiceConfig(text_config=text)   # tokenizers and head: the release's
        torch.manual_seed(cfg.seed)
        Reference(config).save_pretrained(root)
    force_speech(root)
    return root


def force_speech(root: Path) -> None:
    """Greedy decoding picks the audio token at every step: a constant first residual
    dimension (+100 on every embedding and connector output) that only the audio token's
    row of the LM head reads (the other three allowed ids read it negated)."""
    cfg = json.loads((root / "config.json").read_text())
    file = root / "model.safetensors"
    t = load_file(file)
    head = t.get("lm_head.weight", t["model.language_model.embed_tokens.weight"]).clone()
    allowed = [cfg.get(k) for k in ("audio_bos_token_id", "audio_eos_token_id",
                                     "audio_token_id", "eos_token_id")]
    head[allowed] = 0
    head[allowed, 0] = -1.0
    head[cfg["audio_token_id"], 0] = 1.0
    t["lm_head.weight"] = head
    t["model.language_model.embed_tokens.weight"][:, 0] += 100
    for name in ("model.multi_modal_projector", "model.semantic_connector"):
        t[f"{name}.linear_2.bias"][0] += 100
    t["model.language_model.norm.weight"][0] = 1.0
    save_file(t, file, metadata={"format": "pt"})
    cfg["tie_word_embeddings"] = False
    cfg["text_config"]["tie_word_embeddings"] = False
    (root / "config.json").write_text(json.dumps(cfg, indent=2))


def prompt_ids(i: int, cfg_doc: dict) -> list[int]:
    g = torch.Generator().manual_seed(1000 + i)
    vocab = min(cfg_doc["text_config"]["vocab_size"], 240)
    return torch.randint(0, vocab, (PROMPT_LEN - 1,), generator=g).tolist() + \
        [cfg_doc["audio_bos_token_id"]]


def bench_reference(root: Path, cfg: VibeVoiceBenchConfig, device: torch.device,
                    dtype: torch.dtype) -> dict[str, object]:
    from transformers import VibeVoiceForConditionalGeneration as Reference

    doc = json.loads((root / "config.json").read_text())
    ref = Reference.from_pretrained(root, dtype=dtype).to(device).eval()
    seconds, audio = [], []
    for k in range(cfg.reference_requests + 1):          # the first: warm-up
        i = max(k - 1, 0)                                 # request i, as ours numbers them
        ids = torch.tensor([prompt_ids(i, doc)], device=device)
        torch.manual_seed(cfg.seed + i)
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=cfg.num_frames,
                               guidance_scale=cfg.guidance_scale,
                               num_diffusion_steps=cfg.num_diffusion_steps,
                               return_dict_in_generate=True)
        _sync(device)
        if k:
            seconds.append(time.perf_counter() - t0)
            audio.append(out.audio[0].reshape(-1).float().cpu())
    del ref
    return {"e2e_s": summary(seconds), "audio_samples": [len(a) for a in audio],
            "_audio": audio}


def bench_ours(root: Path, cfg: VibeVoiceBenchConfig, device: torch.device,
               dtype: torch.dtype) -> dict[str, object]:
    from omnistage.testing.tiny_vibevoice import PagedLM

    doc = json.loads((root / "config.json").read_text())
    model = VibeVoiceForConditionalGeneration.from_pretrained(root, device, dtype)
    per_seq = PROMPT_LEN + 2 * cfg.num_frames + 8
    blocks = 3 * max(cfg.concurrency) * (per_seq // 4 + 2)
    by_c: dict[str, object] = {}
    for c in (1, *cfg.concurrency):                       # the first c=1: warm-up
        loop = SpeechLoop(model, PagedLM(model, num_blocks=blocks))
        for i in range(c):
            ids = torch.tensor(prompt_ids(i, doc), device=device)
            loop.add(SpeechRequest(str(i), model.embed_input_ids(ids), int(ids[-1]),
                                   cfg.num_frames, torch.Generator().manual_seed(cfg.seed + i),
                                   cfg.guidance_scale, cfg.num_diffusion_steps))
        first: dict[str, float] = {}
        end: dict[str, float] = {}
        _sync(device)
        t0 = time.perf_counter()
        while loop.active:
            loop.step()
            _sync(device)
            now = time.perf_counter() - t0
            for p in loop.active + list(loop.done.values()):
                rid = p.request.request_id
                if p.audio and rid not in first:
                    first[rid] = now
                if p.finished and rid not in end:
                    end[rid] = now
        audio_s = {r: len(torch.cat(p.audio)) / SAMPLE_RATE for r, p in loop.done.items()}
        by_c[str(c)] = {"first_audio_s": summary(list(first.values())),
                        "e2e_s": summary(list(end.values())),
                        "audio_s": sorted(set(audio_s.values())),
                        "rtf": summary([end[r] / audio_s[r] for r in end]),
                        "_audio": [torch.cat(loop.done[str(i)].audio).float().cpu()
                                   for i in range(c)]}
    del model
    return by_c


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(cfg: VibeVoiceBenchConfig) -> dict[str, object]:
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-vibevoice-") as tmp:
        root = build_checkpoint(Path(tmp), cfg)
        ref = bench_reference(root, cfg, device, dtype) if cfg.reference_requests else None
        ours = bench_ours(root, cfg, device, dtype)
        free_device_memory(device)
    ratios: dict[str, float | None] = {
        "vibevoice_rtf_c1": ours["1"]["rtf"]["median"],
        "vibevoice_first_audio_s_c1": ours["1"]["first_audio_s"]["median"]}
    if "8" in ours:
        ratios["vibevoice_first_audio_c8_over_c1"] = (ours["8"]["first_audio_s"]["median"]
                                                      / ours["1"]["first_audio_s"]["median"])
    diff = None
    if ref is not None:
        ratios["vibevoice_e2e_speedup_vs_reference"] = (ref["e2e_s"]["median"]
                                                        / ours["1"]["e2e_s"]["median"])
        a, b = ref["_audio"][0], ours["1"]["_audio"][0]     # request 0, both sides
        diff = float((a - b).abs().max()) if a.shape == b.shape else None
    for row in [*ours.values(), *([ref] if ref else [])]:
        row.pop("_audio")
    return {"benchmark": "vibevoice", **environment(device),
            "dtype": str(dtype).removeprefix("torch."), "config": asdict(cfg),
            "reference": ref, "omnistage": ours, "ratios": ratios,
            "max_abs_audio_diff_request0": diff,
            "targets": {"vibevoice_rtf_c1": 0.1, "vibevoice_first_audio_s_c1": 0.1,
                        "vibevoice_first_audio_c8_over_c1": 1.5,
                        "vibevoice_e2e_speedup_vs_reference": 10.0},
            "notes": "ours: SpeechLoop on the tests' PagedLM runner (not the served graph); "
                     "reference: transformers' generate one request at a time, its first "
                     "audio is its end-to-end time. Both sides: `frames` speech steps."}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--reference-requests", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--out-dir", default="benchmarks/results")
    a = p.parse_args(argv)
    cfg = VibeVoiceBenchConfig(tiny=a.tiny, frames=a.frames,
                               concurrency=tuple(int(c) for c in a.concurrency.split(",")),
                               reference_requests=a.reference_requests, device=a.device)
    result = run(cfg)
    path = write_result(result, a.out_dir, "vibevoice_tiny" if a.tiny else "vibevoice")
    print(json.dumps({"ratios": result["ratios"], "result": str(path)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
