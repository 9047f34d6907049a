"""HunyuanVideo-1.5's transformer at its real shape, ours against diffusers'
`HunyuanVideo15Transformer3DModel` on the same random weights (bf16 on a GPU, float32 on a
CPU): the time of one denoising step with classifier-free guidance as each pipeline runs it.

    diffusers  HunyuanVideo15Pipeline's loop: the guider's conditional call, then the
               unconditional one, each over the full padded context (1000 Qwen tokens,
               256 byT5 tokens, 729 all-zero image tokens, masked)
    ours       HunyuanVideo15Pipeline.velocity's layout: both rows in one call, each context
               stream cut to its valid tokens (the model's `compact`), no image stream

Shape (`--sizes real`, diffusers' default config = the 480p t2v checkpoint: 54 layers, 16 x 128
heads, 8.3B parameters): 848x480 (the 16:9 bucket of 640), 121 frames: 31 x 30 x 53 = 49,290
video tokens a row; a prompt of PROMPT_TOKENS valid Qwen tokens, the negative NEGATIVE_TOKENS,
no glyph text. `--tiny`: a 2-layer model at 80x48, 9 frames, for a CPU.

Timed per variant: diffusers eager; diffusers after `compile_repeated_blocks(fullgraph=True)`;
ours eager; ours with its blocks compiled (`compile_blocks`, a stage's `compile: true`). Each
runs one warm-up step (which compiles) and `timed_steps` timed ones on the same inputs; the
guided velocities of ours and diffusers' eager are compared (max abs difference). The peak
device memory of each side is reported (one model on the device at a time).

    python -m omnistage.benchmarks.hunyuan_video15 [--tiny] [--no-compile] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from omnistage.benchmarks.common import (default_dtype, environment, free_device_memory, now,
                                         ratio, seeded_init)
from omnistage.diffusion.pipeline import compile_blocks
from omnistage.models.hunyuan_video15_transformer import (HunyuanVideo15Transformer3DModel,
                                                          HunyuanVideo15TransformerConfig)
from omnistage.utils.device import resolve_device

REAL = dict(arch={}, size=(480, 848), frames=121, vae=(16, 4), text=1000, glyph=256, image=729)
TINY = dict(arch=dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                      num_layers=2, num_refiner_layers=1, text_embed_dim=24, text_embed_2_dim=20,
                      image_embed_dim=12, rope_axes_dim=(4, 6, 6)),
            size=(48, 80), frames=9, vae=(16, 4), text=40, glyph=16, image=5)
PROMPT_TOKENS, NEGATIVE_TOKENS = 120, 8
GUIDANCE = 6.0


@dataclass(frozen=True, slots=True)
class HunyuanVideo15BenchConfig:
    tiny: bool = False
    timed_steps: int = 3
    compile: bool = True
    device: str = "auto"
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Inputs:
    """One guided request's step: latents + condition channels (1, C, F', h, w), the
    prompt's and the negative prompt's padded states and masks (2, ...), the timestep."""
    x: Tensor
    text: Tensor
    mask: Tensor
    glyph: Tensor
    glyph_mask: Tensor
    image: Tensor
    timestep: Tensor

    @classmethod
    def make(cls, cfg: HunyuanVideo15TransformerConfig, spec: dict, device: torch.device,
             dtype: torch.dtype, seed: int) -> Inputs:
        (height, width), (s, t) = spec["size"], spec["vae"]
        g = torch.Generator().manual_seed(seed)

        def randn(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=g).to(device, dtype)

        x = randn(1, cfg.in_channels, 1 + (spec["frames"] - 1) // t, height // s, width // s)
        mask = torch.zeros(2, spec["text"], device=device, dtype=dtype)
        mask[0, :min(PROMPT_TOKENS, spec["text"])] = 1
        mask[1, :NEGATIVE_TOKENS] = 1
        return cls(x, randn(2, spec["text"], cfg.text_embed_dim), mask,
                   torch.zeros(2, spec["glyph"], cfg.text_embed_2_dim, device=device, dtype=dtype),
                   torch.zeros(2, spec["glyph"], device=device, dtype=dtype),
                   torch.zeros(1, spec["image"], cfg.image_embed_dim, device=device, dtype=dtype),
                   torch.full((1,), 700.0, device=device, dtype=dtype))


Step = Callable[[], Tensor]


def timed(step: Step, n: int, device: torch.device) -> tuple[list[float], Tensor]:
    """Seconds of a warm-up step and n more, and the last step's output."""
    seconds = []
    for _ in range(1 + n):
        t0 = now(device)
        out = step()
        seconds.append(now(device) - t0)
    return seconds, out


def diffusers_step(ref, x: Inputs) -> Step:
    def branch(i: int) -> Tensor:
        return ref(x.x, x.timestep, x.text[i:i + 1], x.mask[i:i + 1],
                   encoder_hidden_states_2=x.glyph[i:i + 1],
                   encoder_attention_mask_2=x.glyph_mask[i:i + 1], image_embeds=x.image,
                   return_dict=False)[0]

    def step() -> Tensor:
        cond, uncond = branch(0), branch(1)
        return uncond + GUIDANCE * (cond - uncond)
    return step


def ours_step(model: HunyuanVideo15Transformer3DModel, x: Inputs) -> Step:
    def step() -> Tensor:
        out = model(x.x.expand(2, -1, -1, -1, -1), x.timestep.expand(2), x.text, x.mask,
                    x.glyph, x.glyph_mask)
        cond, uncond = out[:1], out[1:]
        return uncond + GUIDANCE * (cond - uncond)
    return step


def bench(cfg: HunyuanVideo15BenchConfig, build: Callable[[], torch.nn.Module],
          make_step: Callable, x: Inputs, device: torch.device, dtype: torch.dtype,
          compile_fn: Callable[[torch.nn.Module], object]) -> tuple[dict[str, object], Tensor]:
    """One side: eager, then compiled; its peak memory. The model is freed on return."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.device(device), default_dtype(dtype):
        model = build().eval().requires_grad_(False)
    out: dict[str, object] = {"num_parameters": seeded_init(model, cfg.seed)}
    with torch.inference_mode():
        seconds, result = timed(make_step(model, x), cfg.timed_steps, device)
        out.update(eager_step_s=sum(seconds[1:]) / cfg.timed_steps, eager_steps_s=seconds)
        if cfg.compile:
            compile_fn(model)
            seconds, _ = timed(make_step(model, x), cfg.timed_steps, device)
            out.update(compiled_step_s=sum(seconds[1:]) / cfg.timed_steps,
                       compiled_steps_s=seconds)
    out["peak_memory_bytes"] = (torch.cuda.max_memory_allocated(device)
                                if device.type == "cuda" else None)
    result = result.float().cpu()
    del model
    torch._dynamo.reset()
    free_device_memory(device)
    return out, result


def run(cfg: HunyuanVideo15BenchConfig) -> dict[str, object]:
    import diffusers

    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = TINY if cfg.tiny else REAL
    arch = HunyuanVideo15TransformerConfig(**spec["arch"])
    x = Inputs.make(arch, spec, device, dtype, cfg.seed)
    ref, ref_out = bench(
        cfg, lambda: diffusers.HunyuanVideo15Transformer3DModel(**spec["arch"]),
        diffusers_step, x, device, dtype,
        lambda m: m.compile_repeated_blocks(fullgraph=True))
    ours, ours_out = bench(cfg, lambda: HunyuanVideo15Transformer3DModel(arch), ours_step, x,
                           device, dtype, compile_blocks)
    best = min(v for v in (ours["eager_step_s"], ours.get("compiled_step_s")) if v is not None)
    ratios = {
        "hunyuan_video15_step_speedup_vs_diffusers": ratio(ref["eager_step_s"], best),
        "hunyuan_video15_eager_step_speedup_vs_diffusers": ratio(ref["eager_step_s"],
                                                                 ours["eager_step_s"]),
        "hunyuan_video15_step_speedup_vs_diffusers_compiled": ratio(ref.get("compiled_step_s"),
                                                                    best),
    }
    f, h, w = x.x.shape[2:]
    return {
        "benchmark": "hunyuan_video15", **environment(device),
        "dtype": str(dtype).removeprefix("torch."), "config": asdict(cfg),
        "tokens": {"video": f * h * w, "text_padded": spec["text"],
                   "prompt": min(PROMPT_TOKENS, spec["text"]),
                   "negative": NEGATIVE_TOKENS, "glyph_padded": spec["glyph"],
                   "image_padded": spec["image"]},
        "diffusers": ref, "ours": ours, "ratios": ratios,
        "max_abs_diff": float((ours_out - ref_out).abs().max()),
        "output_max_abs": float(ref_out.abs().max()),
        "notes": "a step: CFG's two rows with the guided mix, as both pipelines run it "
                 "(diffusers: two calls over the padded context; ours: one call of two rows "
                 "over the valid tokens). Speed-ups: diffusers' seconds per step over ours "
                 "(above 1: ours faster); hunyuan_video15_step_speedup_vs_diffusers takes ours' "
                 "best (eager or compiled) against diffusers eager. Random weights, the same "
                 "in both (seeded_init).",
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, for a CPU")
    parser.add_argument("--timed-steps", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run(HunyuanVideo15BenchConfig(args.tiny, args.timed_steps, not args.no_compile,
                                           args.device))
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text, file=sys.stdout)
    return result


if __name__ == "__main__":
    main()
