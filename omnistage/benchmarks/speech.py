"""`omnistage bench speech --family cosyvoice3|voxtral-tts|mimo-audio`: the served speech
pipeline of a family on a random-weight checkpoint at its released shape, built in the run
(speech_checkpoint.py; `--tiny`: the tests' tiny folders, what CI runs on a CPU).

    ours:   the family's default graph as `omnistage serve` runs it (configs/cosyvoice3.yaml,
            voxtral_tts.yaml, mimo_audio.yaml: stage processes, shm connector, chunked edges),
            offline through `Omni` with the speech route's output modalities ({"audio"}); at
            concurrency 1 requests one after another, at c all submitted at once; per
            request: first audio (submission to the first event carrying samples), end to end,
            real-time factor = end to end / seconds of audio; per run: audio seconds per second
            (all requests' audio / makespan) and the device's memory in use at its highest
            (every process: the stages' preallocated KV caches included)

Each request makes exactly `length` steps of the family's speaking stage (the checkpoint's
forcing change, speech_checkpoint.py, keeps random weights from stopping early; greedy, seeds
fixed):

    cosyvoice3   speech tokens, 25 a second       (zero-shot: a 1.2 s reference clip + its text)
    voxtral-tts  frames, 12.5 a second            (the first preset voice; cfg_alpha 1.2)
    mimo-audio   LLM patches of 4 frames, 6.25 a second   (the TTS prompt, `<|empty|>` forced)

Headline fields (`ratios`), issue 43's targets in `targets`:

    <family>_rtf_c1                      real-time factor at concurrency 1     target <= 0.1
    <family>_first_audio_s_c1            first audio at concurrency 1, s       target <= 0.1
    <family>_first_audio_c8_over_c1      first audio at 8 against at 1         target <= 1.5
    <family>_e2e_speedup_vs_reference    null: the upstream references (FunAudioLLM/CosyVoice,
                                         vLLM-Omni's Voxtral-TTS, XiaomiMiMo/MiMo-Audio) are
                                         not installable packages and are not run on the GPU
                                         machine (no network there)

with family cosyvoice3 / voxtral_tts / mimo_audio, plus `<family>_rtf_c{c}`,
`<family>_first_audio_c{c}_over_c1` and `<family>_audio_s_per_s_c{c}` for every c run.
"""

from __future__ import annotations

import queue
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from omnistage.benchmarks.common import environment, free_device_memory, ratio, summary
from omnistage.benchmarks.speech_checkpoint import FAMILIES, build
from omnistage.payloads import AudioChunk
from omnistage.utils.device import resolve_device

TEXTS = ("Hello, the weather is lovely today in the city, and the sky is clear.",
         "Please tell me a short story about the sea, a small boat and its captain.",
         "The quick brown fox jumps over the lazy dog near the river in the morning.",
         "Describe a sunny morning in the mountains in a few simple words for me.",
         "Cook the rice slowly so that it does not stick together in the old pot.",
         "Something interesting about the moon and the stars tonight, if you please.",
         "Take water and a map with you on a long walk in the forest this weekend.",
         "A bicycle keeps its balance because its wheels keep turning as you ride.")
LENGTH = {"cosyvoice3": (100, 12), "voxtral-tts": (50, 8), "mimo-audio": (25, 6)}  # real, tiny
TINY_OVERRIDES = {"cosyvoice3": ("flow_hift.generation.options.token_hop_len=4",
                                 "flow_hift.generation.options.token_max_hop_len=16"),
                  "mimo-audio": ("decoder.generation.options.chunk_frames=8",
                                 "decoder.generation.options.first_chunk_frames=4")}
GREEDY = {"cosyvoice3": ("llm.ar.sampling.temperature=0",)}
REFERENCE_TEXT = "A short tone for the voice."
NOTE_REFERENCE = ("no reference run: the upstream implementations (FunAudioLLM/CosyVoice, "
                  "vLLM-Omni's Voxtral-TTS, XiaomiMiMo/MiMo-Audio) are not installable "
                  "packages and are not run on the GPU machine")


@dataclass(frozen=True, slots=True)
class SpeechBenchConfig:
    family: str = "cosyvoice3"            # one of FAMILIES
    tiny: bool = False
    length: int | None = None             # speaking-stage steps a request (None: LENGTH's)
    concurrency: tuple[int, ...] = (1, 8, 32)
    c1_requests: int = 3                  # requests at concurrency 1, one after another
    device: str = "auto"
    backend: str | None = None            # stage backend (None: process; inproc when tiny)
    seed: int = 0
    stage_overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: choose {', '.join(FAMILIES)}")
        if self.length is not None and self.length < 2:
            raise ValueError(f"length={self.length}: need >= 2")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency={self.concurrency}: need values >= 1")
        if self.c1_requests < 1:
            raise ValueError(f"c1_requests={self.c1_requests}: need >= 1")
        if self.backend not in (None, "process", "inproc"):
            raise ValueError(f"backend={self.backend!r}: choose process or inproc")

    @property
    def key(self) -> str:
        """The family as the result's field names spell it."""
        return self.family.replace("-", "_")

    @property
    def steps(self) -> int:
        return self.length or LENGTH[self.family][self.tiny]

    @property
    def stage_backend(self) -> str:
        return self.backend or ("inproc" if self.tiny else "process")


def reference_clip(seconds: float = 1.2, rate: int = 24000) -> list[float]:
    """CosyVoice3's voice to clone: a modulated tone (what its served golden test sends)."""
    t = np.arange(int(rate * seconds)) / rate
    return (0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).tolist()


def request_params(cfg: SpeechBenchConfig, folder: Path, steps: int) -> list[object]:
    """Every request's sampling params, per stage (the speaking stage's, then None): greedy,
    exactly `steps` steps, the seed fixed (it seeds Voxtral-TTS's flow head)."""
    from omnistage import SamplingParams

    base = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, seed=cfg.seed,
                          detokenize=False)
    if cfg.family == "cosyvoice3":
        extra = {"ref_audio": reference_clip(), "ref_text": REFERENCE_TEXT}
        return [replace(base, ignore_eos=False, extra=extra), None]
    if cfg.family == "voxtral-tts":
        from omnistage.stages.voxtral_tts import preset_voices
        return [replace(base, extra={"voice": preset_voices(folder)[0]}), None]
    return [base, None]


class DeviceMemory:
    """The device's memory in use (all processes), polled every `every_s` from a thread;
    `peak` is its highest reading (None off CUDA)."""

    def __init__(self, device: torch.device, every_s: float = 0.05) -> None:
        self.device, self.every_s, self.peak = device, every_s, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> DeviceMemory:
        if self.device.type == "cuda":
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _poll(self) -> None:
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info(self.device)
            self.peak = max(self.peak or 0, total - free)
            self._stop.wait(self.every_s)


def run_requests(omni, n: int, params: list, tag: str, timeout_s: float = 600.0
                 ) -> list[dict[str, float]]:
    """Submit requests 0..n-1 at once, as the speech route does ({"audio"}), and wait; per
    request: first audio and end to end (from its submission), seconds of audio."""
    events: queue.Queue = queue.Queue()
    start, rate = {}, {}
    for i in range(n):
        rid = f"{tag}-{i}"
        start[rid] = time.perf_counter()
        out = omni.engine.submit(TEXTS[i % len(TEXTS)], params, request_id=rid,
                                 output_modalities={"audio"},
                                 sink=lambda ev: events.put((time.perf_counter(), ev)))
        rate[rid] = out.sample_rate
    return collect_audio(events, start, rate, timeout_s)


def collect_audio(events: queue.Queue, start: dict[str, float], rate: dict[str, int | None],
                  timeout_s: float, text_stage: str | None = None) -> list[dict[str, float]]:
    """Read the submitted requests' (time, event) pairs from `events` until each is done; per
    request: first audio and end to end (from `start`), seconds of audio (at `rate`, or the
    rate its chunks report), and with `text_stage` the time of that stage's last tokens."""
    stats = {rid: {"first_audio_s": None, "e2e_s": None, "samples": 0,
                   **({"last_text_s": None} if text_stage else {})} for rid in start}
    pending, deadline = set(start), time.monotonic() + timeout_s
    while pending:
        t, ev = events.get(timeout=max(1.0, deadline - time.monotonic()))
        s = stats[ev.request_id]
        if ev.error:
            raise RuntimeError(f"request {ev.request_id} failed: {ev.error}")
        if text_stage is not None and ev.stage == text_stage and ev.token_ids:
            s["last_text_s"] = t - start[ev.request_id]
        chunk = AudioChunk.unpack(ev.tensors or {})
        if chunk is not None and chunk.sample_rate:
            rate[ev.request_id] = chunk.sample_rate
        if chunk is not None and chunk.samples is not None and chunk.samples.numel():
            s["samples"] += chunk.samples.numel()
            if s["first_audio_s"] is None:
                s["first_audio_s"] = t - start[ev.request_id]
        if ev.done:
            s["e2e_s"] = t - start[ev.request_id]
            pending.discard(ev.request_id)
    for rid, s in stats.items():
        assert rate[rid], f"{rid}: no sample rate reported"
        s["audio_s"] = s.pop("samples") / rate[rid]
    return list(stats.values())


def measure(omni, cfg: SpeechBenchConfig, params: list) -> dict[str, dict]:
    """Per concurrency c: first audio, end to end, RTF (summaries), audio seconds per second;
    at c = 1 `c1_requests` requests one after another, else c at once."""
    by_c: dict[str, dict] = {}
    for c in cfg.concurrency:
        if c == 1:
            stats = [s for i in range(cfg.c1_requests)
                     for s in run_requests(omni, 1, params, f"c1-{i}")]
            makespan = sum(s["e2e_s"] for s in stats)
        else:
            t0 = time.perf_counter()
            stats = run_requests(omni, c, params, f"c{c}")
            makespan = time.perf_counter() - t0
        audio = [s["audio_s"] for s in stats]
        first = [s["first_audio_s"] for s in stats if s["first_audio_s"] is not None]
        by_c[str(c)] = {
            "requests": len(stats), "makespan_s": makespan, "first_audio_s": summary(first),
            "e2e_s": summary([s["e2e_s"] for s in stats]),
            "rtf": summary([s["e2e_s"] / a for s, a in zip(stats, audio) if a > 0]),
            "audio_s_per_s": sum(audio) / makespan, "audio_s": audio,
            "requests_without_audio": len(stats) - len(first)}
    return by_c


def bench_ours(folder: Path, cfg: SpeechBenchConfig, device: torch.device,
               dtype: torch.dtype) -> dict[str, object]:
    from omnistage import Omni

    params = request_params(cfg, folder, cfg.steps)
    warm = [replace(params[0], max_tokens=min(4, cfg.steps)), None]
    kw: dict[str, object] = {"backend": "inproc", "connector": "inproc"} \
        if cfg.stage_backend == "inproc" else {}
    overrides = [*GREEDY.get(cfg.family, ()),
                 *(TINY_OVERRIDES.get(cfg.family, ()) if cfg.tiny else ()),
                 *cfg.stage_overrides]
    with DeviceMemory(device) as memory:
        t0 = time.perf_counter()
        with Omni(str(folder), device=str(device), dtype=str(dtype).removeprefix("torch."),
                  stage_overrides=overrides, **kw) as omni:
            startup = time.perf_counter() - t0
            run_requests(omni, 1, params, "warm")                      # at full length
            run_requests(omni, max(cfg.concurrency), warm, "warm-batch")
            by_c = measure(omni, cfg, params)
    return {"startup_s": startup, "stage_overrides": overrides, "by_concurrency": by_c,
            "peak_device_memory_gb": None if memory.peak is None else memory.peak / 1e9}


def headline(cfg: SpeechBenchConfig, by_c: dict[str, dict]) -> dict[str, float | None]:
    k, one = cfg.key, by_c.get("1")
    first1 = None if one is None else one["first_audio_s"]["median"]
    out: dict[str, float | None] = {
        f"{k}_rtf_c1": None if one is None else one["rtf"]["median"],
        f"{k}_first_audio_s_c1": first1, f"{k}_first_audio_c8_over_c1": None,
        f"{k}_e2e_speedup_vs_reference": None}
    for c, row in by_c.items():
        out[f"{k}_rtf_c{c}"] = row["rtf"]["median"]
        out[f"{k}_audio_s_per_s_c{c}"] = row["audio_s_per_s"]
        if c != "1":
            out[f"{k}_first_audio_c{c}_over_c1"] = ratio(row["first_audio_s"]["median"], first1)
    return out


def run(cfg: SpeechBenchConfig) -> dict[str, object]:
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-speech-") as tmp:
        t0 = time.perf_counter()
        folder = build(cfg.family, cfg.tiny, Path(tmp) / cfg.family, cfg.seed, device)
        build_s = time.perf_counter() - t0
        free_device_memory(device)
        ours = bench_ours(folder, cfg, device, dtype)
        free_device_memory(device)
    k = cfg.key
    return {
        "benchmark": "speech", "family": cfg.family, **environment(device),
        "dtype": str(dtype).removeprefix("torch."),
        "config": {**asdict(cfg), "steps": cfg.steps, "backend": cfg.stage_backend,
                   "sizes": "tiny (tests/helpers)" if cfg.tiny else
                   "released shapes (omnistage/benchmarks/speech_checkpoint.py)"},
        "checkpoint_build_s": build_s, "reference": None, "omnistage": ours,
        "ratios": headline(cfg, ours["by_concurrency"]),
        "peak_device_memory_gb": ours["peak_device_memory_gb"],
        "targets": {f"{k}_rtf_c1": 0.1, f"{k}_first_audio_s_c1": 0.1,
                    f"{k}_first_audio_c8_over_c1": 1.5, f"{k}_e2e_speedup_vs_reference": 10.0},
        "notes": f"{k}_e2e_speedup_vs_reference is null: {NOTE_REFERENCE}. first_audio: "
                 "seconds from submission to the first audio chunk; rtf: end-to-end seconds "
                 "per second of audio; audio_s_per_s: all requests' audio over the makespan. "
                 "peak_device_memory_gb: the device's memory in use at its highest, every "
                 "process (stage KV caches are preallocated by memory_fraction).",
    }
