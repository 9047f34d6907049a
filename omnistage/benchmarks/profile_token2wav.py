"""Where Qwen2.5-Omni's streamed token2wav spends its time under concurrency, outside the
runtime: one RK4 step of the DiT windows in flight (a CUDA graph of `dit_step`, as the stage
replays it) at 1 ... 21 windows of the steady shape and the first window's, and the vocoder's
windows, each timed alone; then the variants worth trying, in the same run: the DiT step
compiled by torch.compile before its graph is captured, and the vocoder in bfloat16 (with its
waveform's SNR against float32). A kernel table of one steady step at 8 windows says what the
time is made of. The token2wav of bench omni25's checkpoint (BENCH_SIZES: a DiT of 22 layers
of 1024, BigVGAN from 1536 channels), random weights, built in the run.

    python -m omnistage.benchmarks.profile_token2wav --out /tmp/t2w.json
    python -m omnistage.benchmarks.profile_token2wav --device cpu --tiny   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from omnistage.benchmarks.common import environment
from omnistage.benchmarks.profile_tts import kernel_table
from omnistage.diffusion.pipeline import compile_blocks, uncompile_blocks
from omnistage.diffusion.solvers.rk4 import sway_times
from omnistage.generation.token2wav import Token2WavOptions, quantize_dit
from omnistage.generation.token2wav_graphs import plan_shapes
from omnistage.generation.token2wav_stream import Chunking, dit_step
from omnistage.layers.fp8 import MIN_FEATURES
from omnistage.layers.graph_capture import ShapeGraphs
from omnistage.models.qwen2_5_omni.token2wav import Token2Wav, Token2WavConfig

AUDIO_S_PER_FRAME = 240 / 24000          # a mel frame: 240 samples at 24 kHz


def build(device: torch.device, tiny: bool) -> Token2Wav:
    from omnistage.benchmarks.omni25 import bench_config
    from omnistage.testing.tiny_omni import build_tiny_omni_tokenizer
    from omnistage.testing.tiny_qwen2_5_omni import tiny_qwen2_5_omni_config

    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tiny_omni_tokenizer(Path(tmp))
        config = tiny_qwen2_5_omni_config(tokenizer) if tiny else bench_config(tokenizer)
    torch.manual_seed(0)
    with torch.device(device):
        model = Token2Wav(Token2WavConfig.from_hf(config)).eval()
    return model


def timed(fn, args: tuple, device: torch.device, iters: int) -> float:
    """Milliseconds a call, after two warm-up calls (a graph's capture among them)."""
    for _ in range(2):
        fn(*args)
    if device.type != "cuda":
        import time
        t = time.perf_counter()
        for _ in range(iters):
            fn(*args)
        return (time.perf_counter() - t) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / iters


def dit_args(model: Token2Wav, rows: int, frames: int, times: torch.Tensor) -> tuple:
    cfg, dev = model.cfg.dit, times.device
    gen = torch.Generator(device="cpu").manual_seed(rows * 1000 + frames)
    steps = torch.zeros(rows, dtype=torch.long, device=dev)
    speaker = torch.randn(rows, cfg.enc_dim, generator=gen).to(dev)
    return (torch.randn(rows, frames, cfg.mel_dim, generator=gen).to(dev), times[steps],
            times[steps + 1], torch.randn(rows, cfg.enc_emb_dim, generator=gen).to(dev),
            speaker, speaker.clone(),
            torch.randint(0, min(100, cfg.num_embeds), (rows, frames // cfg.repeats), generator=gen).to(dev),
            torch.full((rows,), frames, device=dev))


def dit_variants(model: Token2Wav, chunking: Chunking, rows_list: list[int],
                 device: torch.device, iters: int, compile_too: bool) -> dict[str, object]:
    """ms an RK4 step of `rows` windows, eager / graph / compiled graph, and the audio seconds
    a GPU second of steps gives at each (a window's chunk is `chunk_blocks` blocks)."""
    o = Token2WavOptions()
    times = sway_times(o.num_steps, o.sway_coefficient, device)
    block = model.cfg.dit.block_size
    steady = (chunking.left_blocks + chunking.chunk_blocks + chunking.right_blocks) * block
    first = (chunking.first_chunk_blocks + chunking.right_blocks) * block
    step = partial(dit_step, model.dit, o.guidance_scale)
    variants = ["eager"] + (["graph"] if device.type == "cuda" else [])
    if compile_too and device.type == "cuda":
        variants.append("compiled_graph")     # Token2WavOptions.compile: the blocks compiled
    out: dict[str, object] = {"steady_frames": steady, "first_frames": first}
    with torch.inference_mode():
        for name in variants:
            fn = step
            if name == "compiled_graph":
                compile_blocks(model.dit)
            if name != "eager":
                fn = ShapeGraphs(step, max_graphs=64, capture_after=1)
            res = {}
            for rows in rows_list:
                for frames in ((first, steady) if rows == 1 else (steady,)):
                    ms = timed(fn, dit_args(model, rows, frames, times), device,
                               iters if name != "eager" else max(2, iters // 4))
                    chunk_s = chunking.chunk_blocks * block * AUDIO_S_PER_FRAME * rows
                    res[f"rows{rows}_frames{frames}"] = {
                        "ms_per_step": ms,
                        "audio_s_per_gpu_s": chunk_s / (o.num_steps * ms / 1e3)}
                    print(f"dit {name} rows {rows} frames {frames}: {ms:.2f} ms a step",
                          file=sys.stderr, flush=True)
            out[name] = res
        uncompile_blocks(model.dit)
    return out


def dit_kernels(model: Token2Wav, chunking: Chunking, rows: int, device: torch.device
                ) -> dict[str, object]:
    o = Token2WavOptions()
    times = sway_times(o.num_steps, o.sway_coefficient, device)
    steady = (chunking.left_blocks + chunking.chunk_blocks + chunking.right_blocks) * \
        model.cfg.dit.block_size
    args = dit_args(model, rows, steady, times)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with torch.inference_mode():
        dit_step(model.dit, o.guidance_scale, *args)
        with profile(activities=activities) as prof:
            dit_step(model.dit, o.guidance_scale, *args)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    return kernel_table(prof, 1, device, top=20)


def vocoder_variants(model: Token2Wav, chunking: Chunking, device: torch.device, iters: int,
                     rows: tuple[int, ...] = (1, 8)) -> dict[str, object]:
    """ms a vocoder forward of `rows` windows (first and steady), float32 (graph) against
    bfloat16 (graph) and float32 with its blocks compiled (graph, CUDA only), and each
    waveform's SNR against float32's eager one."""
    _, mel_shapes = plan_shapes(model, chunking, 4096, 8)
    mel_dim = model.cfg.dit.mel_dim
    voc = model.code2wav_bigvgan_model
    out: dict[str, object] = {"lengths": list(mel_shapes.lengths)}
    gen = torch.Generator(device="cpu").manual_seed(1)
    with torch.inference_mode():
        inputs = {(b, n): torch.randn(b, n, mel_dim, generator=gen).to(device) * 2 - 4
                  for b in rows for n in mel_shapes.lengths}
        ref = {k: model.vocode(x).float() for k, x in inputs.items()}
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16),
                            ("float32_compiled", torch.float32)):
            if name.endswith("compiled") and device.type != "cuda":
                continue
            voc.to(dtype)
            if name.endswith("compiled"):
                compile_blocks(voc)
            def fn(mel: torch.Tensor, dtype: torch.dtype = dtype) -> torch.Tensor:
                return model.vocode(mel.to(dtype)).float()
            if device.type == "cuda":
                fn = ShapeGraphs(fn, max_graphs=8, capture_after=1)
            res = {}
            for (b, n), x in inputs.items():
                ms = timed(fn, (x,), device, iters)
                wave = fn(x)
                err = (wave - ref[b, n]).pow(2).mean().item()
                snr = 10 * math.log10(ref[b, n].pow(2).mean().item() / max(err, 1e-30))
                res[f"rows{b}_frames{n}"] = {"ms": ms, "snr_db_vs_float32": round(snr, 2),
                                             "audio_s_per_gpu_s": b * n * AUDIO_S_PER_FRAME
                                             / (ms / 1e3)}
                print(f"vocoder {name} rows {b} frames {n}: {ms:.2f} ms, {snr:.1f} dB",
                      file=sys.stderr, flush=True)
            out[name] = res
        voc.to(torch.float32)
        uncompile_blocks(voc)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the test checkpoint's sizes")
    p.add_argument("--rows", default="1,2,4,8,16,21")
    p.add_argument("--vocoder-rows", default="1,8,16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--vocoder-only", action="store_true")
    p.add_argument("--no-vocoder", action="store_true", help="the DiT's figures only")
    p.add_argument("--dit-quantization", choices=("none", "fp8", "int8"), default="none",
                   help="the DiT's block linears quantized (Token2WavOptions.dit_quantization)")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    model = build(device, a.tiny)
    o = Token2WavOptions()
    chunking = Chunking(o.chunk_blocks, o.first_chunk_blocks, o.left_blocks, o.right_blocks)
    model.dit.fuse_qkv()                            # as the stage: q, k, v in one matmul
    if device.type == "cuda":
        model.dit.compute_in(torch.bfloat16)        # the stage's default on CUDA
    if a.dit_quantization != "none":
        quantize_dit(model.dit, a.dit_quantization, 16 if a.tiny else MIN_FEATURES, a.tiny)
    rows = [int(r) for r in a.rows.split(",")]
    result = {"benchmark": "profile_token2wav", **environment(device),
              "dit_dtype": "bfloat16" if device.type == "cuda" else "float32",
              "dit_quantization": a.dit_quantization,
              "chunking": {"chunk_blocks": o.chunk_blocks, "first": o.first_chunk_blocks,
                           "left": o.left_blocks, "right": o.right_blocks,
                           "block_frames": model.cfg.dit.block_size},
              "dit": None if a.vocoder_only else dit_variants(model, chunking, rows, device, a.iters, not a.no_compile),
              "dit_kernels_rows8": None if a.vocoder_only else dit_kernels(model, chunking, min(8, max(rows)), device),
              "vocoder": None if a.no_vocoder else vocoder_variants(
                  model, chunking, device, a.iters,
                  tuple(int(r) for r in a.vocoder_rows.split(",")))}
    text = json.dumps(result, indent=1)
    if a.out:
        a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
