"""Qwen3-TTS (CustomVoice) on our stage runtime against `qwen-tts`'s own
`generate_custom_voice`, on a random-weight checkpoint built in the run (issue 20, part 5).

    qwen-tts:   its `Qwen3TTSModel` (transformers 4.57.3, sdpa attention), one request at a
                time (its generate takes a batch, not a stream of arrivals); the waveform
                comes back whole, so its first audio = its end-to-end time; a queue of c
                requests takes c times as long (estimated from `reference_requests` runs)
    ours:       the default graph (configs/qwen3_tts.yaml: talker on the AR engine ->
                code2wav, stage processes, shm connector, chunked edge with a short first
                chunk): at concurrency 1 requests one after another, at c all submitted at
                once; per request: first audio (submission to the first event carrying
                audio), end-to-end latency, real-time factor = latency / seconds of audio

Both sides: greedy talker and code predictor, repetition penalty 1.05 (the release's), speaker
Ryan, English, texts of about a sentence, exactly `frames` talker steps (the checkpoint's codec
head has a zero EOS row, so greedy decoding never stops early; ours also ignores EOS): the same
frames of audio on both sides, 12.5 a second.

Headline figures (`ratios` in the JSON) and issue 20's targets:

    tts_rtf_c1                  real-time factor at concurrency 1        target <= 0.08
    tts_first_audio_s_c1        first audio at concurrency 1, seconds     target <= 0.050
    tts_first_audio_c8_over_c1  first audio at 8 against at 1             target <= 1.5

plus `tts_first_audio_over_qwen_tts_e2e_c1`, `tts_e2e_speedup_c1`,
`tts_audio_throughput_ratio_c{c}` (audio seconds per second against qwen-tts's, one at a time)
and `tts_first_audio_over_qwen_tts_queue_latency_c{c}` (against its estimated mean latency).

Model ("1.7b"): Qwen3-TTS-12Hz-1.7B-CustomVoice's sizes (tts_reference.py: talker 28 layers of
2048, code predictor 5 of 1024, 16 code groups, 151936-row text embedding; the 12 Hz speech
tokenizer at qwen-tts's defaults), qwen-tts's own init, the tiny test tokenizer (text ids are
few; the embedding keeps its size). "tiny": the golden tests' CustomVoice checkpoint (CPU, CI).

The checkpoint is built by qwen-tts's classes in the reference's interpreter (tts_reference.py,
by subprocess, on the device, bfloat16 on CUDA), which then times its requests and exits,
leaving the GPU to ours. That interpreter: $OMNISTAGE_TTS_REF_PYTHON if set, else .venv-ref's
python (scripts/setup.sh --test makes it on machines without a GPU), else this one; with
$OMNISTAGE_TTS_REF_PYTHONPATH put first on its PYTHONPATH (a `pip install --target` folder).

On a GPU machine without .venv-ref (the device: Python 3.12, torch, transformers 5, no
network) the reference's packages travel as wheels into their own folder: transformers 4.57.3
wants huggingface-hub < 1 and tokenizers <= 0.23.0, which transformers 5's environment lacks;
librosa is left behind (tts_reference.py stands in for it: numba's llvmlite alone is 60 MB).
Fetched here, into .whl/ref/ (git-ignored):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 -d .whl/ref qwen-tts==0.1.1 transformers==4.57.3 \\
        huggingface-hub==0.36.0 tokenizers==0.22.1 accelerate==1.12.0 einops==0.8.2 \\
        soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 psutil requests urllib3 idna \\
        charset-normalizer certifi

(18 MB), and on the device, with our own wheels in .whl/ (benchmarks/device_session.sh, whose
`STAGES=tts` runs exactly this):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ref-site \\
        .whl/ref/*.whl
    OMNISTAGE_TTS_REF_PYTHONPATH=/tmp/ref-site python3 -m omnistage.entrypoints.cli.main \\
        bench tts
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from omnistage.benchmarks.common import environment, free_device_memory
from omnistage.benchmarks.omni import (audio_ratios, measure_concurrency, one_at_a_time,
                                       run_requests)
from omnistage.testing.tiny_tts import REFERENCE_PYTHON
from omnistage.utils.device import resolve_device

REFERENCE_SCRIPT = Path(__file__).with_name("tts_reference.py")
REFERENCE_TIMEOUT_S = 1200
TEXTS = ("Hello, the weather is lovely today in the city.",
         "Please tell me a short story about the sea and a boat.",
         "The quick brown fox jumps over the lazy dog near the river.",
         "Describe a sunny morning in the mountains in a few words.",
         "Cook the rice slowly so that it does not stick together.",
         "Something interesting about the moon and the stars tonight.",
         "Take water and a map with you on a long walk in the forest.",
         "A bicycle keeps its balance because its wheels keep turning.")
VOICE = {"1.7b": ("ryan", "english"), "tiny": ("vivian", "english")}


@dataclass(frozen=True, slots=True)
class TTSBenchConfig:
    sizes: str = "1.7b"                   # 1.7b | tiny
    frames: int = 100                     # talker steps a request: 99 frames, 7.9 s
    concurrency: tuple[int, ...] = (1, 8, 32)
    reference_requests: int = 3           # 0: ours only, no ratios against qwen-tts
    device: str = "auto"
    backend: str = "process"              # stage backend of our runtime
    first_chunk_frames: int | None = None  # code2wav's first chunk (None: the graph's 2)
    seed: int = 0
    stage_overrides: tuple[str, ...] = ()  # STAGE.KEY=VALUE on our graph

    def __post_init__(self) -> None:
        if self.sizes not in VOICE:
            raise ValueError(f"sizes={self.sizes!r}: choose 1.7b or tiny")
        if self.frames < 2:
            raise ValueError(f"frames={self.frames}: need >= 2")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency={self.concurrency}: need values >= 1")
        if self.reference_requests < 0:
            raise ValueError(f"reference_requests={self.reference_requests}: must be >= 0 "
                             "(0: ours only, no ratios against qwen-tts)")
        if self.first_chunk_frames is not None and self.first_chunk_frames < 1:
            raise ValueError(f"first_chunk_frames={self.first_chunk_frames}: must be >= 1")
        if self.backend not in ("process", "inproc"):
            raise ValueError(f"backend={self.backend!r}: choose process or inproc")

    @classmethod
    def preset(cls, sizes: str, *, frames: int | None = None, backend: str | None = None,
               **kw: object) -> TTSBenchConfig:
        tiny = sizes == "tiny"
        return cls(sizes=sizes, frames=frames or (8 if tiny else 100),
                   backend=backend or ("inproc" if tiny else "process"), **kw)


def reference_interpreter() -> tuple[str, dict[str, str]]:
    """The reference's python and environment (see the module docstring)."""
    env = dict(os.environ)
    site = env.get("OMNISTAGE_TTS_REF_PYTHONPATH")
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    python = env.get("OMNISTAGE_TTS_REF_PYTHON")
    if python is None:
        python = str(REFERENCE_PYTHON) if REFERENCE_PYTHON.is_file() and not site \
            else sys.executable
    return python, env


def build_and_reference(root: Path, cfg: TTSBenchConfig, device: torch.device
                        ) -> tuple[Path, dict | None]:
    """Run tts_reference.py: the checkpoint's folder, and qwen-tts's raw timings (None when
    `reference_requests` is 0)."""
    from omnistage.testing.tiny_omni import build_tiny_omni_tokenizer

    build_tiny_omni_tokenizer(root / "tokenizer")
    speaker, language = VOICE[cfg.sizes]
    (root / "job.json").write_text(json.dumps({
        "sizes": cfg.sizes, "device": str(device), "seed": cfg.seed, "frames": cfg.frames,
        "requests": cfg.reference_requests, "texts": TEXTS, "speaker": speaker,
        "language": language}))
    python, env = reference_interpreter()
    done = subprocess.run([python, str(REFERENCE_SCRIPT), str(root)], env=env,
                          capture_output=True, text=True, timeout=REFERENCE_TIMEOUT_S,
                          check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise RuntimeError(f"the qwen-tts reference ({python}) failed (exit "
                           f"{done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return root / "custom_voice", json.loads((root / "reference.json").read_text())


def summarize_reference(raw: dict, cfg: TTSBenchConfig) -> dict[str, object]:
    """qwen-tts's requests as bench omni reports transformers'."""
    audio_s = [n / raw["sample_rate"] for n in raw["audio_samples"]]
    return {**one_at_a_time(raw["seconds"], audio_s, cfg.concurrency),
            "frames": raw["frames"], "sample_rate": raw["sample_rate"],
            "attn_implementation": raw["attn_implementation"], "versions": raw["versions"]}


def bench_ours(path: Path, cfg: TTSBenchConfig, device: torch.device, dtype: torch.dtype
               ) -> dict[str, object]:
    from omnistage import Omni, SamplingParams

    speaker, language = VOICE[cfg.sizes]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=cfg.frames,
                            ignore_eos=True, detokenize=False,
                            extra={"voice": speaker, "language": language})
    kw: dict[str, object] = {"backend": "inproc", "connector": "inproc"} \
        if cfg.backend == "inproc" else {}
    overrides = [] if cfg.first_chunk_frames is None else \
        [f"code2wav.generation.options.first_chunk_frames={cfg.first_chunk_frames}"]
    overrides += cfg.stage_overrides
    t0 = time.perf_counter()
    with Omni(str(path), device=str(device), dtype=str(dtype).removeprefix("torch."),
              stage_overrides=overrides, **kw) as omni:
        startup = time.perf_counter() - t0
        run_requests(omni, [TEXTS[0]], params, "warm")           # at full length
        warm = replace(params, max_tokens=4)
        run_requests(omni, [TEXTS[i % len(TEXTS)] for i in range(max(cfg.concurrency))],
                     warm, "warm-batch")
        by_c = measure_concurrency(omni, lambda i: TEXTS[i % len(TEXTS)], params,
                                   cfg.concurrency, cfg.reference_requests or 2)
    for row in by_c.values():
        row.pop("text_tokens")                               # the talker emits codes only
    return {"startup_s": startup, "by_concurrency": by_c}


def run(cfg: TTSBenchConfig) -> dict[str, object]:
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-tts-") as tmp:
        path, raw = build_and_reference(Path(tmp), cfg, device)
        ref = summarize_reference(raw, cfg) if raw is not None else None
        ours = bench_ours(path, cfg, device, dtype)
        free_device_memory(device)
    by_c = ours["by_concurrency"]
    ratios = audio_ratios(by_c, ref, cfg.concurrency, "qwen_tts", prefix="tts_")
    if "1" in by_c:
        ratios["tts_first_audio_s_c1"] = by_c["1"]["first_audio_s"]["median"]
    lengths = {a for row in by_c.values() for a in row["audio_s"]} | set(ref["audio_s"]
                                                                        if ref else ())
    return {
        "benchmark": "tts", **environment(device), "dtype": str(dtype).removeprefix("torch."),
        "config": asdict(cfg), "reference": ref, "omnistage": ours, "ratios": ratios,
        "equal_audio": len(lengths) == 1,     # every request of both sides: the same seconds
        "targets": {"tts_rtf_c1": 0.08, "tts_first_audio_s_c1": 0.05,
                    "tts_first_audio_c8_over_c1": 1.5},
        "notes": "reference: qwen-tts's Qwen3TTSModel.generate_custom_voice, greedy, one "
                 "request at a time. first_audio: seconds from submission to the first audio "
                 "chunk (qwen-tts returns the waveform whole: its end-to-end time). rtf: "
                 "end-to-end seconds per second of audio. qwen-tts at concurrency c: makespan "
                 "and mean latency estimated from its measured per-request time. Both sides "
                 "make exactly `frames` talker steps.",
    }
