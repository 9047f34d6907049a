"""Time code2wav's vocoder (bench sizes, random weights, bf16) per window shape: the first call
of a new shape against repeats, with cuDNN on and off, eager and CUDA graph replay.

    python scripts/profile_code2wav.py [out.json]
"""

from __future__ import annotations

import json
import sys
import time

import torch

from omnistage.benchmarks.omni import BENCH_SIZES
from omnistage.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig


def clock(fn, reps: int = 1) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main(out: str | None) -> None:
    sizes = dict(BENCH_SIZES["code2wav"])
    sizes["upsample_rates"] = tuple(sizes["upsample_rates"])
    sizes["upsampling_ratios"] = tuple(sizes["upsampling_ratios"])
    cfg = Code2WavConfig(**sizes)
    model = Code2Wav(cfg).to("cuda", torch.bfloat16).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    res: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "cudnn": torch.backends.cudnn.version()}
    shapes = [(1, 12), (1, 37), (1, 38), (2, 37), (7, 12), (8, 37), (8, 40), (8, 75), (16, 37)]

    def run(b: int, n: int):
        x = torch.randn(b, n, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        return lambda: model.vocode(x)

    with torch.inference_mode():
        for cudnn in (True, False):
            torch.backends.cudnn.enabled = cudnn
            rows = {}
            for b, n in shapes:
                f = run(b, n)
                first = clock(f)
                rows[f"{b}x{n}"] = {"first_ms": first, "repeat_ms": clock(f, 5)}
            res[f"vocode_cudnn_{cudnn}"] = rows
            print(cudnn, json.dumps(rows, indent=None))
        torch.backends.cudnn.enabled = True
        graphs = {}
        for b, n in [(1, 37), (8, 37), (16, 37)]:
            x = torch.randn(b, n, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
            for _ in range(2):
                model.vocode(x)
            g = torch.cuda.CUDAGraph()
            t0 = time.perf_counter()
            with torch.cuda.graph(g):
                model.vocode(x)
            cap = (time.perf_counter() - t0) * 1e3
            graphs[f"{b}x{n}"] = {"capture_ms": cap, "replay_ms": clock(g.replay, 10)}
        res["vocode_graph"] = graphs
        print("graphs", json.dumps(graphs))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        tr = model.pre_transformer
        P = tr.num_cached
        pre = {}
        backends = {"default": None, "efficient": [SDPBackend.EFFICIENT_ATTENTION],
                    "math": [SDPBackend.MATH], "cudnn": [SDPBackend.CUDNN_ATTENTION]}
        for name, backend in backends.items():
            rows = {}
            for b, n in [(1, 12), (1, 25), (8, 25), (8, 26), (3, 25)]:
                h = torch.randn(b, n, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
                past = torch.zeros(b, cfg.num_hidden_layers, 2, P, cfg.num_key_value_heads,
                                   cfg.head_dim, device="cuda", dtype=torch.bfloat16)
                num_past = torch.full((b,), P, device="cuda")
                num_new = torch.full((b,), n, device="cuda")

                def f():
                    if backend is None:
                        return tr.forward_cached(h, past, num_past, num_new)
                    with sdpa_kernel(backend):
                        return tr.forward_cached(h, past, num_past, num_new)
                try:
                    rows[f"{b}x{n}"] = {"first_ms": clock(f), "repeat_ms": clock(f, 5)}
                except RuntimeError as exc:
                    rows[f"{b}x{n}"] = str(exc)[:200]
            pre[name] = rows
            print("pre", name, json.dumps(rows))
        res["pre_transformer_cached"] = pre
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
