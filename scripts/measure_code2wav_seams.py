"""How far a streamed Qwen3-Omni waveform is from the whole decode, by left context.

    .venv/bin/python scripts/measure_code2wav_seams.py [--frames 100] [--device cpu]

Builds transformers' `Qwen3OmniMoeCode2Wav` at its real size (8 sliding-window layers of 72,
hidden 1024, decoder 1536, 24 kHz), draws its weights as the tests do (fan-in scaled, so that
every layer matters) and scales its last conv so that random codes peak near 0.5 (audible;
transformers' own init decodes to ~1e-6, where any error hides). Then decodes random codes
whole (transformers, what generate(return_audio=True) returns up to 300 frames) and streamed
by our `Code2WavStream` with the shipped chunking (first chunk 12, chunks 25) at several left
contexts, and prints, per context: the length check, the largest and RMS error against the
whole decode, the SNR, and the largest step at a chunk seam against the whole decode's largest
step between neighbouring samples. Random weights are not trained ones: on the real model the
error at a given context must be measured anew.
"""

from __future__ import annotations

import argparse
import json
import math

import torch


def main() -> None:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeCode2WavConfig)
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeCode2Wav)

    from omnistage.models.loader import load_packed_weights
    from omnistage.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig
    from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStream
    from omnistage.testing.tiny_omni import _randomize, make_audible

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--contexts", default="1,4,8,12,25")
    ap.add_argument("--first-chunk", type=int, default=12)
    ap.add_argument("--chunk", type=int, default=25)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    hf_cfg = Qwen3OmniMoeCode2WavConfig()
    ref = Qwen3OmniMoeCode2Wav(hf_cfg).float().eval()
    with torch.no_grad():
        _randomize(ref, args.seed)
    make_audible(ref, seed=args.seed)
    ref = ref.to(args.device)
    ours = Code2Wav(Code2WavConfig.from_hf(hf_cfg)).to(args.device).eval()
    with torch.no_grad():
        loaded = load_packed_weights(ours, ref.state_dict().items(), Code2Wav.packed_modules)
    assert loaded == {n for n, _ in ours.named_parameters()}, "weights not all loaded"

    gen = torch.Generator().manual_seed(args.seed + 1)
    codes = torch.randint(0, hf_cfg.codebook_size, (hf_cfg.num_quantizers, args.frames),
                          generator=gen).to(args.device)
    with torch.no_grad():
        whole = ref(codes[None])[0, 0].float().cpu()
    upsample, lost = ours.total_upsample, ours.num_lost
    seams, end = [], args.first_chunk
    while end < args.frames:
        seams.append(end * upsample - lost)
        end += args.chunk
    largest_step = whole.diff().abs().max().item()
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        stream = Code2WavStream(ours, args.chunk, ctx, args.first_chunk)
        with torch.no_grad():
            wav = torch.cat([stream.push(codes[:, i:i + 1]) for i in range(args.frames)]
                            + [stream.flush()]).cpu()
        err = wav - whole
        rms_err = err.pow(2).mean().sqrt().item()
        rms = whole.pow(2).mean().sqrt().item()
        row = {"left_context": ctx, "samples": wav.numel(), "whole_samples": whole.numel(),
               "max_abs_error": err.abs().max().item(), "rms_error": rms_err,
               "snr_db": 20 * math.log10(rms / rms_err) if rms_err > 0 else float("inf"),
               "max_seam_step": max(abs(wav[b] - wav[b - 1]).item() for b in seams),
               "whole_largest_step": largest_step}
        rows.append(row)
        print(json.dumps({k: round(v, 5) if isinstance(v, float) else v
                          for k, v in row.items()}))
    run = {"frames": args.frames, "first_chunk": args.first_chunk, "chunk": args.chunk,
           "device": args.device, "peak": whole.abs().max().item(),
           "receptive_field_frames": ours.cfg.receptive_field_frames, "seams": len(seams)}
    print(json.dumps(run))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "code2wav_stream_error", **run, "by_context": rows,
                       "notes": __doc__}, f, indent=2)


if __name__ == "__main__":
    main()
