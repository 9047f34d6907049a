"""What cuDNN's attention costs the first time it meets a sequence length (it builds and caches
a graph per shape) against its later calls and flash's, at a DiT's shape: Qwen-Image at 1024 px
(B=1, H=24, D=128, S = 4096 image tokens + a caption's). A diffusion stage keeps cuDNN's kernel
(`diffusion.cudnn_attention`, stages/process.py); this says what a new prompt length costs.

    python -m omnistage.benchmarks.kernels.sdpa_first_call --out /tmp/sdpa_first_call.json

Per backend and caption length: the first call's wall time (synchronized), the median of 10
later calls, in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from omnistage.benchmarks.common import environment


def _call_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    F.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def measure(text_lens: list[int], image_tokens: int = 4096, heads: int = 24,
            head_dim: int = 128) -> dict[str, dict[str, dict[str, float]]]:
    """backend -> caption length -> {first_ms, later_ms}."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        rows: dict[str, dict[str, float]] = {}
        with sdpa_kernel([backend]):
            for text in text_lens:
                q, k, v = (torch.randn(1, heads, image_tokens + text, head_dim, device="cuda",
                                       dtype=torch.bfloat16) for _ in range(3))
                first = _call_ms(q, k, v)
                later = statistics.median(_call_ms(q, k, v) for _ in range(10))
                rows[str(text)] = {"first_ms": first, "later_ms": later}
        out[name] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text-lens", default="64,37,101,230,64")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = {**environment(torch.device("cuda")), "cudnn": torch.backends.cudnn.version(),
              "by_backend": measure([int(t) for t in args.text_lens.split(",")])}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
