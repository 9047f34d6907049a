"""How far Qwen2.5-Omni's streamed token2wav is from the whole decode, and why it cannot be
exact at a useful latency.

    .venv/bin/python scripts/measure_token2wav_seams.py [--codes 150] [--model tiny|released]

Builds the tiny test checkpoint (DiT blocks of 4 frames, 3 layers: 0 and 2 look back, 1 ahead)
or the tiny width with the released attention pattern (blocks of 24 frames, 22 layers: 0 and
20 look back, 10 ahead), weights drawn and scaled as the tests do (audible), and prints:

1. the receptive field of the mel in DiT blocks: from the layer pattern (per evaluation, one
   block back per look-back layer, one ahead per look-ahead layer; times 4 (num_steps - 1)
   evaluations), and as measured: one code changed in the middle of a long sequence, the
   blocks of the whole decode's mel that change at all, and by how much per distance;
2. per chunking (chunk, first chunk, left and right context, in blocks), the streamed
   waveform (Token2WavGenerator, codes arriving one at a time as the talker writes them)
   against the whole decode (same noise): largest error, SNR in dB, and the first audio's
   codes (how many codes must exist before the first samples come out).

Random weights are not trained ones: how fast influence decays with distance is a property of
the weights, so on the released checkpoint these errors must be measured anew (same script,
`--checkpoint DIR`).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch

CHUNKINGS = "4,2,2,2;4,2,2,1;4,2,1,1;4,2,4,4;2,2,2,2;8,2,2,2;4,2,8,8"   # chunk,first,left,right


def decode(generator, codes: torch.Tensor, speaker: int, per_call: int) -> tuple[torch.Tensor,
                                                                                   int | None]:
    """Feed `per_call` codes a call (the talker's pace), then step to the end; the audio and
    how many codes had been fed when the first samples came out."""
    state: dict = {}
    outs, first = [], None
    fed = 0
    with torch.inference_mode():
        while fed < codes.numel() or generator.has_backlog(state):
            x = codes[fed:fed + per_call]
            inp = {"codes": x, "speaker": torch.full_like(x, speaker)} if x.numel() else {}
            fed += x.numel()
            out = generator.generate([inp], [state], [fed >= codes.numel()])[0]
            if out:
                outs.append(out["audio"])
                first = fed if first is None else first
    return torch.cat(outs), first


def receptive_field(generator, codes: torch.Tensor, block_codes: int) -> dict[str, object]:
    """Change the code in the middle block; per block of mel, the largest change (whole
    decode, float64 to see small changes; the model is back in float32 after)."""
    model = generator.model.double()
    dit, rows = model.dit, generator.speakers[0]
    rows = type(rows)(*(t.double() for t in (rows.cond, rows.speaker, rows.null_speaker)))
    times = generator.times.double()
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(1, codes.numel() * dit.cfg.repeats, dit.cfg.mel_dim, generator=gen,
                        dtype=torch.float64).to(times.device)

    def mel(c: torch.Tensor) -> torch.Tensor:
        from omnistage.diffusion.solvers.rk4 import rk4_step
        x = noise
        for i in range(times.shape[0] - 1):
            x = rk4_step(lambda t, y: dit.guided_velocity(
                y, t.reshape(1), rows.cond, rows.speaker, rows.null_speaker, c[None].to(y.device),
                generator.guidance_scale), times, i, x)
        return x[0]

    with torch.inference_mode():
        a = mel(codes)
        mid = codes.numel() // 2 // block_codes * block_codes
        changed = codes.clone()
        changed[mid] = (changed[mid] + 1) % 64
        b = mel(changed)
    block = dit.cfg.block_size
    per_block = (a - b).abs().reshape(-1, block, a.shape[-1]).amax(dim=(1, 2)).cpu()
    at = mid // block_codes
    moved = (per_block > 0).nonzero().flatten()
    generator.model.float()
    return {"changed_block": at, "blocks_back_changed": at - int(moved.min()),
            "blocks_ahead_changed": int(moved.max()) - at,
            "largest_change_by_distance": {d: float(per_block[at + d]) for d in
                                           (-16, -8, -4, -2, -1, 0, 1, 2, 4, 8, 16)
                                           if 0 <= at + d < per_block.numel()}}


def main() -> None:
    from omnistage.generation.token2wav import Token2WavGenerator, Token2WavOptions
    from omnistage.testing.tiny_qwen2_5_omni import (
        RELEASED_DIT_BLOCKS,
        build_tiny_qwen2_5_omni,
    )

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "released"], default="tiny")
    ap.add_argument("--checkpoint", default=None, help="a Qwen2.5-Omni folder instead")
    ap.add_argument("--codes", type=int, default=150)
    ap.add_argument("--per-call", type=int, default=1, help="codes fed per engine step")
    ap.add_argument("--chunkings", default=CHUNKINGS, help="chunk,first,left,right;... (blocks)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = ap.parse_args()

    path = Path(args.checkpoint) if args.checkpoint else Path(tempfile.mkdtemp()) / "omni25"
    if not args.checkpoint:
        build_tiny_qwen2_5_omni(path, dit_overrides=RELEASED_DIT_BLOCKS
                                if args.model == "released" else None)
    device = torch.device(args.device)
    whole = Token2WavGenerator.from_pretrained(path, "", device, None,
                                               Token2WavOptions(chunk_blocks=0))
    cfg = whole.model.cfg.dit
    codes = torch.randint(0, 64, (args.codes,), generator=torch.Generator().manual_seed(1))
    evals = 4 * (whole.times.shape[0] - 1)
    rows: dict[str, object] = {
        "model": args.checkpoint or args.model, "codes": args.codes,
        "block_size": cfg.block_size, "evaluations": evals,
        "field_blocks_from_layers": {"back": evals * len(cfg.look_backward_layers),
                                     "ahead": evals * len(cfg.look_ahead_layers)},
        "vocoder_context_frames": whole.model.code2wav_bigvgan_model.context_frames}
    block_codes = cfg.block_size // cfg.repeats
    if args.codes * cfg.repeats <= 1200:
        rows["measured"] = receptive_field(whole, codes, block_codes)
    reference, _ = decode(whole, codes, 0, args.codes)
    rms = reference.pow(2).mean().sqrt().item()
    rows["reference_peak"], rows["reference_rms"] = reference.abs().max().item(), rms
    rows["chunkings"] = []
    for chunk, first, left, right in (map(int, c.split(",")) for c in args.chunkings.split(";")):
        opts = Token2WavOptions(chunk_blocks=chunk, first_chunk_blocks=first, left_blocks=left,
                                right_blocks=right)
        gen = Token2WavGenerator.from_pretrained(path, "", device, None, opts)
        audio, first_codes = decode(gen, codes, 0, args.per_call)
        assert audio.shape == reference.shape, (audio.shape, reference.shape)
        err = (audio - reference)
        snr = 10 * math.log10(reference.pow(2).sum().item() / max(err.pow(2).sum().item(),
                                                                   1e-30))
        rows["chunkings"].append({"chunk": chunk, "first": first, "left": left, "right": right,
                                  "max_abs_err": err.abs().max().item(), "snr_db": snr,
                                  "first_audio_after_codes": first_codes})
    print(json.dumps(rows, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
