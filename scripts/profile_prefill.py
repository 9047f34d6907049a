"""Where a Qwen3-Omni thinker prefill goes (bench sizes, random weights, bf16 on CUDA): one
request's, then eight at once, each timed and profiled (torch.profiler, CUDA and CPU time
per op).

    python scripts/profile_prefill.py OUT_DIR
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from omnistage.benchmarks.omni import PROMPTS, build_checkpoint
from omnistage.configs.defaults import stage_config_text
from omnistage.configs.graph import load_graph
from omnistage.sampling_params import SamplingParams
from omnistage.stages.factory import build_stage_engine
from omnistage.stages.interface import StageRequest


def prefill(stage, prompts: list[list[int]], tag: str) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, ids in enumerate(prompts):
        stage.add(StageRequest(f"{tag}-{i}", time.time(), params, prompt_token_ids=ids))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    stage.step()                          # the prefill of every request added
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    while stage.has_unfinished_requests:
        stage.step()
    return seconds


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.enable_cudnn_sdp(False)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "omni"
        model = build_checkpoint("bench", path, torch.device("cuda"), torch.bfloat16)
        del model
        torch.cuda.empty_cache()
        graph = load_graph(stage_config_text("qwen3_omni"), [f"model={path}"])
        stage = build_stage_engine(graph.stage("thinker"), str(path), "cuda:0")
        tok = stage.engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                           add_generation_prompt=True) for p in PROMPTS]
        prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
        for _ in range(3):
            prefill(stage, prompts[:1], "warm1")
            prefill(stage, prompts, "warm8")
        lines = []
        for n in (1, 8):
            secs = [prefill(stage, prompts[:n], f"t{n}") for _ in range(5)]
            lines.append(f"prefill of {n} ({sum(map(len, prompts[:n]))} tokens): "
                         f"{sorted(secs)[2] * 1e3:.1f} ms median of 5")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                prefill(stage, prompts[:n], f"p{n}")
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
            (out / f"prefill_{n}.txt").write_text(table)
            table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
            (out / f"prefill_{n}_cpu.txt").write_text(table)
        (out / "summary.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
