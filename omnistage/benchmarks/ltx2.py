"""LTX-2's transformer at its real shape, ours against diffusers' `LTX2VideoTransformer3DModel`
on the same random weights (bf16 on a GPU, float32 on a CPU): the time of one denoising step
as both pipelines run it with diffusers' default guidance, i.e. two transformer calls a step:

    1. the prompt and the negative prompt rows together (CFG: a batch of 2)
    2. the prompt row again with the audio-video attention off (modality guidance: 1 row)

Shape (`--sizes real`): LTX-2.0 (48 layers, video 32 x 128 heads, audio 32 x 64, Gemma 3's
3840-wide text), 768x512, 121 frames at 24 fps: 16 x 16 x 24 = 6,144 video tokens, 126
audio tokens, 1024 text tokens. `--tiny`: a 2-layer model at 64x64, 9 frames, for a CPU.

Timed per variant: diffusers eager; diffusers after `compile_repeated_blocks(fullgraph=True)`;
ours eager; ours with its blocks compiled (`compile_blocks`, a stage's `compile: true`). Each
runs one warm-up step (which compiles) and `timed_steps` timed ones on the same inputs; the
outputs of ours and diffusers' eager are compared (max abs difference, both streams).

    python -m omnistage.benchmarks.ltx2 [--tiny] [--no-compile] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from omnistage.benchmarks.common import (default_dtype, environment, free_device_memory, now,
                                         ratio, seeded_init)
from omnistage.diffusion.pipeline import compile_blocks
from omnistage.models.ltx2_transformer import (LTX2TransformerConfig,
                                               LTX2VideoTransformer3DModel, Positions)
from omnistage.utils.device import resolve_device

REAL = dict(arch={}, size=(512, 768), frames=121, text=1024)          # diffusers' defaults
TINY = dict(arch=dict(in_channels=8, out_channels=8, num_attention_heads=2,
                      attention_head_dim=16, cross_attention_dim=32, audio_in_channels=16,
                      audio_out_channels=16, audio_num_attention_heads=2,
                      audio_attention_head_dim=8, audio_cross_attention_dim=16, num_layers=2,
                      caption_channels=24),
            size=(64, 64), frames=9, text=32)
FPS = 24.0


@dataclass(frozen=True, slots=True)
class LTX2BenchConfig:
    tiny: bool = False
    timed_steps: int = 3
    compile: bool = True
    device: str = "auto"
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Inputs:
    video: Tensor          # (2, N, C): the same latents twice (CFG's rows)
    audio: Tensor          # (2, T, Ca)
    text: Tensor           # (2, L, caption): prompt, negative prompt
    audio_text: Tensor
    mask: Tensor           # (2, L)
    timestep: Tensor       # (2,)
    positions: Positions

    @classmethod
    def make(cls, cfg: LTX2TransformerConfig, spec: dict, device: torch.device,
             dtype: torch.dtype, seed: int) -> Inputs:
        height, width = spec["size"]
        s, t = cfg.vae_scale_factors[1], cfg.vae_scale_factors[0]
        grid = ((spec["frames"] - 1) // t + 1, height // s, width // s)
        per_second = cfg.audio_sampling_rate / cfg.audio_hop_length / cfg.audio_scale_factor
        audio_frames = round(spec["frames"] / FPS * per_second)
        g = torch.Generator().manual_seed(seed)

        def randn(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=g).to(device, dtype)

        video = randn(1, math.prod(grid), cfg.in_channels).expand(2, -1, -1)
        audio = randn(1, audio_frames, cfg.audio_in_channels).expand(2, -1, -1)
        mask = torch.ones(2, spec["text"], device=device)
        mask[1, : spec["text"] // 2] = 0                       # the negative prompt's padding
        return cls(video, audio, randn(2, spec["text"], cfg.caption_channels),
                   randn(2, spec["text"], cfg.caption_channels), mask,
                   torch.full((2,), 700.0, device=device), Positions(grid, FPS, audio_frames))


Step = Callable[[], tuple[Tensor, Tensor]]


def timed(step: Step, n: int, device: torch.device) -> tuple[list[float], tuple[Tensor, Tensor]]:
    """Seconds of a warm-up step and n more, and the last step's outputs."""
    seconds = []
    for _ in range(1 + n):
        t0 = now(device)
        out = step()
        seconds.append(now(device) - t0)
    return seconds, out


def diffusers_step(ref, x: Inputs) -> Step:
    f, h, w = x.positions.grid
    kw = dict(timestep=x.timestep, sigma=x.timestep, num_frames=f, height=h, width=w, fps=FPS,
              audio_num_frames=x.positions.audio_frames, use_cross_timestep=True,
              return_dict=False)

    def step() -> tuple[Tensor, Tensor]:
        v, a = ref(x.video, x.audio, x.text, x.audio_text, encoder_attention_mask=x.mask,
                   audio_encoder_attention_mask=x.mask, **kw)
        ref(x.video[:1], x.audio[:1], x.text[:1], x.audio_text[:1],
            encoder_attention_mask=x.mask[:1], audio_encoder_attention_mask=x.mask[:1],
            isolate_modalities=True, **{**kw, "timestep": x.timestep[:1],
                                        "sigma": x.timestep[:1]})
        return v, a
    return step


def ours_step(model: LTX2VideoTransformer3DModel, x: Inputs) -> Step:
    def step() -> tuple[Tensor, Tensor]:
        v, a = model(x.video, x.audio, x.text, x.audio_text, x.timestep, x.positions,
                     encoder_attention_mask=x.mask, use_cross_timestep=True)
        model(x.video[:1], x.audio[:1], x.text[:1], x.audio_text[:1], x.timestep[:1],
              x.positions, encoder_attention_mask=x.mask[:1], use_cross_timestep=True,
              isolate_modalities=True)
        return v, a
    return step


def bench_diffusers(cfg: LTX2BenchConfig, arch: dict, x: Inputs, device: torch.device,
                    dtype: torch.dtype) -> tuple[dict[str, object], tuple[Tensor, Tensor]]:
    import diffusers

    with torch.device(device), default_dtype(dtype):
        ref = diffusers.LTX2VideoTransformer3DModel(**arch).eval().requires_grad_(False)
    out: dict[str, object] = {"num_parameters": seeded_init(ref, cfg.seed)}
    with torch.inference_mode():
        seconds, result = timed(diffusers_step(ref, x), cfg.timed_steps, device)
        out.update(eager_step_s=sum(seconds[1:]) / cfg.timed_steps, eager_steps_s=seconds)
        if cfg.compile:
            ref.compile_repeated_blocks(fullgraph=True)
            seconds, _ = timed(diffusers_step(ref, x), cfg.timed_steps, device)
            out.update(compiled_step_s=sum(seconds[1:]) / cfg.timed_steps,
                       compiled_steps_s=seconds)
    result = tuple(t.float().cpu() for t in result)
    del ref
    free_device_memory(device)
    return out, result


def bench_ours(cfg: LTX2BenchConfig, arch: dict, x: Inputs, device: torch.device,
               dtype: torch.dtype) -> tuple[dict[str, object], tuple[Tensor, Tensor]]:
    with torch.device(device), default_dtype(dtype):
        model = LTX2VideoTransformer3DModel(LTX2TransformerConfig(**arch)).eval()
    model.requires_grad_(False)
    seeded_init(model, cfg.seed)
    out: dict[str, object] = {}
    with torch.inference_mode():
        seconds, result = timed(ours_step(model, x), cfg.timed_steps, device)
        out.update(eager_step_s=sum(seconds[1:]) / cfg.timed_steps, eager_steps_s=seconds)
        if cfg.compile:
            compile_blocks(model)
            seconds, _ = timed(ours_step(model, x), cfg.timed_steps, device)
            out.update(compiled_step_s=sum(seconds[1:]) / cfg.timed_steps,
                       compiled_steps_s=seconds)
    result = tuple(t.float().cpu() for t in result)
    del model
    free_device_memory(device)
    return out, result


def run(cfg: LTX2BenchConfig) -> dict[str, object]:
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = TINY if cfg.tiny else REAL
    arch = LTX2TransformerConfig(**spec["arch"])
    x = Inputs.make(arch, spec, device, dtype, cfg.seed)
    ref, ref_out = bench_diffusers(cfg, spec["arch"], x, device, dtype)
    ours, ours_out = bench_ours(cfg, spec["arch"], x, device, dtype)
    best = min(v for v in (ours["eager_step_s"], ours.get("compiled_step_s")) if v is not None)
    ratios = {
        "ltx2_step_speedup_vs_diffusers": ratio(ref["eager_step_s"], best),
        "ltx2_eager_step_speedup_vs_diffusers": ratio(ref["eager_step_s"], ours["eager_step_s"]),
        "ltx2_step_speedup_vs_diffusers_compiled": ratio(ref.get("compiled_step_s"), best),
    }
    return {
        "benchmark": "ltx2", **environment(device), "dtype": str(dtype).removeprefix("torch."),
        "config": asdict(cfg), "tokens": {"video": x.video.shape[1], "audio": x.audio.shape[1],
                                          "text": x.text.shape[1]},
        "diffusers": ref, "ours": ours, "ratios": ratios,
        "max_abs_diff": {"video": float((ours_out[0] - ref_out[0]).abs().max()),
                         "audio": float((ours_out[1] - ref_out[1]).abs().max())},
        "peak_memory_bytes": (torch.cuda.max_memory_allocated(device)
                              if device.type == "cuda" else None),
        "notes": "a step: the CFG call over 2 rows and the modality-guidance call over 1, as "
                 "both pipelines run diffusers' default guidance. Speed-ups: diffusers' "
                 "seconds per step over ours (above 1: ours faster); "
                 "ltx2_step_speedup_vs_diffusers takes ours' best (eager or compiled) "
                 "against diffusers eager. Random weights, the same in both (seeded_init).",
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, for a CPU")
    parser.add_argument("--timed-steps", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run(LTX2BenchConfig(args.tiny, args.timed_steps, not args.no_compile,
                                 args.device))
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text, file=sys.stdout)
    return result


if __name__ == "__main__":
    main()
