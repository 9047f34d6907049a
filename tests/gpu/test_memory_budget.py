"""GPU-only: stages sharing one GPU keep to their shares. Qwen3-Omni's default graph puts the
thinker, the talker and code2wav on device 0 (memory_fraction 0.75 and 0.12 for the two AR
stages); after start-up and a request each stage process holds at most its share of the device
(plus its CUDA context), read from the driver's per-process accounting."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import msgspec
import pytest
import torch

from omnistage import Omni, SamplingParams
from omnistage.stages.info import StageInfo

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CONTEXT_GIB = 1.0      # a CUDA context, cuBLAS / Triton workspaces: outside any stage's share


def _used_gib_by_pid() -> dict[int, float]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         check=True).stdout
    used = {}
    for line in out.strip().splitlines():
        pid, mib = (part.strip() for part in line.split(","))
        used[int(pid)] = int(mib) / 1024
    return used


class _PeakSampler(threading.Thread):
    """Each process's peak GPU memory while the stages start (printed if a start fails)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peaks: dict[int, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            for pid, gib in _used_gib_by_pid().items():
                self.peaks[pid] = max(self.peaks.get(pid, 0.0), gib)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_omni_stages_keep_to_their_shares(tmp_path: Path, dtype: str) -> None:
    from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

    ckpt = build_tiny_qwen3_omni(tmp_path / "omni")
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    shares = {"thinker": 0.75, "talker": 0.12}
    sampler = _PeakSampler()
    sampler.start()
    try:
        omni = Omni(str(ckpt), device="cuda", dtype=dtype)
    except Exception:
        print("peak GiB by pid during start-up:", sampler.peaks)
        raise
    finally:
        sampler.stop.set()
    with omni:
        params = [SamplingParams(temperature=0.0, max_tokens=8),
                  SamplingParams(temperature=0.0, max_tokens=20), None]
        outs = omni.generate([{"messages": [{"role": "user", "content": "Hi"}]}], params)
        assert outs[0].tensors.get("audio") is not None
        used = _used_gib_by_pid()
        pids = omni.engine.orchestrator.stage_pids()
        report = {name: {"pid": pid, "used_gib": round(used.get(pid, 0.0), 2),
                         "share_gib": round(shares.get(name, 0) * total_gib, 2),
                         "start_peak_gib": round(sampler.peaks.get(pid, 0.0), 2),
                         "info": msgspec.to_builtins(
                             omni.engine.orchestrator.stage_info.get(name, StageInfo()))}
                  for name, pid in pids.items()}
    print(json.dumps(report, indent=1, default=str))
    for name, share in shares.items():
        assert report[name]["used_gib"] <= share * total_gib + CONTEXT_GIB, report
    assert report["code2wav"]["used_gib"] <= 2 * CONTEXT_GIB, report
