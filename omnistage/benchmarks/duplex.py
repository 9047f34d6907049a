"""Full-duplex Moshi at scale (issue 45): how many sessions one GPU ticks in real time. The
duplex runtime itself (engine/duplex.py, the ticker the /v1/duplex server runs), driven in
process by clients that speak as live microphones do; no HTTP in the figure.

    model       a random-weight Moshi at the released Moshi-7B shape (kyutai/moshiko, as
                transformers' MoshiConfig defaults: temporal transformer 32 layers of 4096,
                32 heads, FFN 22528 (gated: 11264), 32000 text tokens, 8 codebooks of 2048;
                depth transformer 6 layers of 1024, 16 heads, FFN 5632, per-codebook
                weights; Mimi at 24 kHz, 1920 samples a frame: 12.5 Hz, an 80 ms tick),
                built by transformers' own classes and init, saved, loaded by MoshiDuplex;
                bfloat16 on CUDA, float32 on the CPU. --tiny: the duplex tests' tiny Moshi
                (testing/moshi_duplex.py: the same 1920-sample frames, a 128-frame context)
    per N       N sessions opened together (they join at the same tick), each fed its own
                speech-like audio (testing/speech_like.py, PCM16 24 kHz) one frame a tick
                by the clock, `lead_frames` ahead (a client's jitter buffer), until every
                session has had warmup_ticks + ticks ticks; then closed
    a tick      its latency is the batched step's wall time (TickEvent.latency_ms: the
                Mimi encodes, the engine step, the Mimi decodes of all N sessions); a missed
                tick ended after the next tick was due; a missed input found no frame
                buffered (the session heard silence)

The first `warmup_ticks` ticks of each N are left out of every figure (their count and their
missed ticks are stated): the joining prefill, and the CUDA graphs captured lazily at a new
batch size. Per N (`by_sessions`): tick latency p50 / p90 / p99 / max in ms, missed ticks per
session, missed inputs, real-time factor (mean tick latency over the tick: under 1 keeps up),
and wall seconds over audio seconds of the measured ticks.

Headline figures (`ratios`), issue 45's target on an H100 in parentheses:

    duplex_sessions_per_gpu      the largest N whose p99 tick latency <= 80 ms with no
                                 missed tick after warm-up (>= 16); 0 when none
    duplex_tick_p99_ms           p99 tick latency at that N (<= 80); None when none
    duplex_tick_p99_ms_c1        p99 tick latency of one session alone
    duplex_tick_p99_ms_c{N}, duplex_missed_ticks_per_session_c{N}, for every N
"""

from __future__ import annotations

import functools
import math
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from omnistage.benchmarks.common import default_dtype, environment, free_device_memory
from omnistage.engine.duplex import DuplexRuntime, TickEvent
from omnistage.stages.moshi_duplex import MoshiDuplex
from omnistage.testing.speech_like import pcm16, speech_like
from omnistage.utils.device import resolve_device

TICK_LIMIT_MS = 80.0        # issue 45: p99 tick latency within one 12.5 Hz frame
STALL_S = 300.0             # no tick for this long: the run is stuck
# ticks a session can last: the model's context less the unconditional frame
CONTEXT_FRAMES = {"7b": 2999, "tiny": 127}

# kyutai/moshiko's config (transformers' MoshiConfig defaults), written out so that a change
# of transformers' defaults cannot change the benchmark's model
MOSHI_7B: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, head_dim=128, ffn_dim=22528, num_codebooks=8,
    max_position_embeddings=3000, rms_norm_eps=1e-8,
    depth_decoder_config=dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=16,
                              num_key_value_heads=16, ffn_dim=5632, num_codebooks=8,
                              audio_vocab_size=2048, max_position_embeddings=9),
    audio_encoder_config=dict(model_type="mimi", sampling_rate=24000, hidden_size=512,
                              num_filters=64, upsampling_ratios=[8, 6, 5, 4],
                              num_hidden_layers=8, num_attention_heads=8,
                              num_key_value_heads=8, intermediate_size=2048,
                              codebook_size=2048, codebook_dim=256, num_quantizers=32,
                              num_semantic_quantizers=1, sliding_window=250,
                              max_position_embeddings=8000))


@dataclass(frozen=True, slots=True)
class DuplexBenchConfig:
    sizes: str = "7b"                         # 7b | tiny
    sessions: tuple[int, ...] = (1, 4, 8, 16, 24, 32)
    ticks: int = 200                          # measured ticks per session (16 s of audio)
    warmup_ticks: int = 10                    # left out of every figure, per N
    lead_frames: int = 2                      # frames a client has sent before it is heard
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sizes not in CONTEXT_FRAMES:
            raise ValueError(f"sizes={self.sizes!r}: choose 7b or tiny")
        if not self.sessions or min(self.sessions) < 1:
            raise ValueError(f"sessions={self.sessions}: need values >= 1")
        if len(set(self.sessions)) != len(self.sessions):
            raise ValueError(f"sessions={self.sessions}: each N once")
        if self.ticks < 2 or self.warmup_ticks < 1 or self.lead_frames < 1:
            raise ValueError(f"ticks={self.ticks}, warmup_ticks={self.warmup_ticks}, "
                             f"lead_frames={self.lead_frames}: need ticks >= 2, warm-up "
                             "and lead >= 1")
        context = CONTEXT_FRAMES[self.sizes]
        if self.ticks + self.warmup_ticks > context:
            raise ValueError(f"ticks={self.ticks} + warmup_ticks={self.warmup_ticks}: more "
                             f"than a {self.sizes} session's {context} frames of context")


def build_checkpoint(sizes: str, path: Path, device: torch.device, dtype: torch.dtype,
                     seed: int) -> Path:
    """The random-weight Moshi folder (transformers' own classes and init)."""
    if sizes == "tiny":
        from omnistage.testing.moshi_duplex import build_duplex_moshi

        return build_duplex_moshi(path, seed)[0]
    from transformers import MoshiConfig, MoshiForConditionalGeneration

    torch.manual_seed(seed)
    config = MoshiConfig(**MOSHI_7B)
    with torch.device(device), default_dtype(dtype):
        model = MoshiForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    del model
    free_device_memory(device)
    return path


class Client:
    """One session's side: its audio, and the events it got (with their arrival times)."""

    def __init__(self, audio: bytes, wanted: int) -> None:
        self.audio = audio
        self.wanted = wanted
        self.events: list[tuple[float, TickEvent]] = []
        self.ended: str | None = None
        self.done = threading.Event()

    def deliver(self, ev: TickEvent | None, reason: str | None) -> None:
        if ev is None:
            self.ended = reason
            self.done.set()
            return
        self.events.append((time.monotonic(), ev))
        if len(self.events) >= self.wanted:
            self.done.set()



@functools.lru_cache(maxsize=64)
def _speech(seconds: float, rate: int, seed: int) -> bytes:
    """A session's voice as PCM16 (made once per session index, reused for every N)."""
    return pcm16(speech_like(seconds, rate=rate, seed=seed))


def drive(model: MoshiDuplex, n: int, cfg: DuplexBenchConfig) -> list[Client]:
    """N sessions on a fresh runtime, fed in real time until each had its ticks."""
    wanted = cfg.warmup_ticks + cfg.ticks
    frames = wanted + cfg.lead_frames
    seconds = frames * model.frame_size / model.sample_rate
    clients = [Client(_speech(seconds, model.sample_rate, cfg.seed + i), wanted)
               for i in range(n)]
    runtime = DuplexRuntime(model, max_buffer_s=2 * seconds)
    sessions = [runtime.open(c.deliver) for c in clients]     # all join the first tick
    fb = runtime.frame_bytes
    for s, c in zip(sessions, clients):
        s.append(c.audio[:cfg.lead_frames * fb])
    runtime.start()
    try:
        start, sent, seen, last = time.monotonic(), cfg.lead_frames, 0, time.monotonic()
        while not all(c.done.is_set() for c in clients):
            due = (start + (sent - cfg.lead_frames + 1) * runtime.tick_s if sent < frames
                   else math.inf)                       # all sent: wait for the last ticks
            time.sleep(max(0.0, min(due - time.monotonic(), 0.05)))
            now = time.monotonic()
            if now >= due and sent < frames:
                for s, c in zip(sessions, clients):
                    s.append(c.audio[sent * fb:(sent + 1) * fb])
                sent += 1
            count = sum(len(c.events) for c in clients)
            if count != seen:
                seen, last = count, now
            elif now - last > STALL_S:
                raise TimeoutError(f"{n} sessions: no tick for {STALL_S:.0f} s")
            if not runtime.is_alive:
                raise RuntimeError("the duplex runtime's ticker died")
        for s in sessions:
            runtime.close(s)
    finally:
        runtime.shutdown()
    ended = [c.ended for c in clients if c.ended not in (None, "shutdown")]
    if ended or any(len(c.events) < wanted for c in clients):
        raise RuntimeError(f"{n} sessions: a session ended early ({ended or 'too few ticks'})")
    return clients


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def row(clients: list[Client], cfg: DuplexBenchConfig, tick_s: float) -> dict[str, Any]:
    """One N's figures from its sessions' events, warm-up left out."""
    w, t = cfg.warmup_ticks, cfg.ticks
    measured = [c.events[w:w + t] for c in clients]
    # the sessions joined together, so tick j of each is the same batched step
    latency = [max(m[j][1].latency_ms for m in measured) for j in range(t)]
    missed = [sum(ev.missed for _, ev in m) for m in measured]
    inputs = [sum(ev.input_missed for _, ev in m) for m in measured]
    warm_missed = max(sum(ev.missed for _, ev in c.events[:w]) for c in clients)
    wall = statistics.fmean(m[-1][0] - m[0][0] for m in measured)
    return {
        "sessions": len(clients), "ticks": t, "warmup_ticks": w,
        "warmup_missed_ticks": warm_missed,
        "tick_ms": {"p50": percentile(latency, 0.5), "p90": percentile(latency, 0.9),
                    "p99": percentile(latency, 0.99), "max": max(latency),
                    "mean": statistics.fmean(latency)},
        "missed_ticks_per_session": statistics.fmean(missed),
        "missed_ticks_per_session_max": max(missed),
        "missed_inputs": sum(inputs), "missed_inputs_per_session_max": max(inputs),
        "heard_frames": sum(ev.heard for m in measured for _, ev in m),
        "audio_frames_out": sum(ev.audio is not None for m in measured for _, ev in m),
        "rtf": statistics.fmean(latency) / 1000 / tick_s,
        "wall_over_audio": wall / ((t - 1) * tick_s)}


def headline(by_sessions: dict[str, dict[str, Any]], limit_ms: float = TICK_LIMIT_MS
             ) -> dict[str, float | int | None]:
    """`ratios`: the largest N within the limit (p99 <= limit_ms, no missed tick), its p99,
    one session's p99, and every N's p99 and missed ticks per session."""
    rows = sorted(by_sessions.values(), key=lambda r: r["sessions"])
    ok = [r for r in rows if r["tick_ms"]["p99"] <= limit_ms
          and r["missed_ticks_per_session_max"] == 0]
    best = ok[-1] if ok else None
    one = next((r for r in rows if r["sessions"] == 1), None)
    out: dict[str, float | int | None] = {
        "duplex_sessions_per_gpu": best["sessions"] if best else 0,
        "duplex_tick_p99_ms": best["tick_ms"]["p99"] if best else None,
        "duplex_tick_p99_ms_c1": one["tick_ms"]["p99"] if one else None}
    for r in rows:
        out[f"duplex_tick_p99_ms_c{r['sessions']}"] = r["tick_ms"]["p99"]
        out[f"duplex_missed_ticks_per_session_c{r['sessions']}"] = r["missed_ticks_per_session"]
    return out


def run(cfg: DuplexBenchConfig, save: Callable[[dict], object] | None = None
        ) -> dict[str, object]:
    """The result; `save` gets it so far after each N (a run cut short keeps those)."""
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    by_sessions: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-duplex-") as tmp:
        t0 = time.perf_counter()
        path = build_checkpoint(cfg.sizes, Path(tmp) / "moshi", device, dtype, cfg.seed)
        built = time.perf_counter() - t0
        model = MoshiDuplex(path, device=str(device), dtype=str(dtype).removeprefix("torch."),
                            max_sessions=max(cfg.sessions))
        loaded = time.perf_counter() - t0 - built
    tick_s = model.frame_size / model.sample_rate
    for n in cfg.sessions:
        r = by_sessions[str(n)] = row(drive(model, n, cfg), cfg, tick_s)
        print(f"duplex: {n} sessions: tick p50 {r['tick_ms']['p50']:.1f} ms, p99 "
              f"{r['tick_ms']['p99']:.1f} ms, missed ticks {r['missed_ticks_per_session']:g} "
              f"a session, missed inputs {r['missed_inputs']}", file=sys.stderr, flush=True)
        if save is not None:
            save(_result(cfg, model, device, dtype, by_sessions, built, loaded))
    return _result(cfg, model, device, dtype, by_sessions, built, loaded)


def _result(cfg: DuplexBenchConfig, model: MoshiDuplex, device: torch.device,
            dtype: torch.dtype, by_sessions: dict[str, dict[str, Any]], built: float,
            loaded: float) -> dict[str, object]:
    tick_s = model.frame_size / model.sample_rate
    return {"benchmark": "duplex", **environment(device),
            "dtype": str(dtype).removeprefix("torch."), "config": asdict(cfg),
            "model": {"sizes": cfg.sizes, "hidden_size": model.cfg.hidden_size,
                      "num_hidden_layers": model.cfg.num_hidden_layers,
                      "num_codebooks": model.cfg.num_codebooks,
                      "depth_hidden_size": model.cfg.depth.hidden_size,
                      "depth_num_hidden_layers": model.cfg.depth.num_hidden_layers,
                      "frame_size": model.frame_size, "sample_rate": model.sample_rate},
            "tick_ms": tick_s * 1000, "tick_limit_ms": TICK_LIMIT_MS,
            "checkpoint_build_s": built, "load_s": loaded,
            "complete": len(by_sessions) == len(cfg.sessions),     # else: saved so far
            "by_sessions": by_sessions, "ratios": headline(by_sessions),
            "notes": f"tick latency: the batched step's wall time (all N sessions' Mimi "
                     f"encodes, one engine step, their Mimi decodes). The first "
                     f"{cfg.warmup_ticks} ticks of each N (joining prefill, CUDA graphs "
                     f"captured at a new batch size) are left out of every figure; "
                     f"warmup_missed_ticks counts the missed ones among them. "
                     f"duplex_sessions_per_gpu: the largest N with p99 <= {TICK_LIMIT_MS:g} "
                     f"ms and no missed tick. Audio is fed one frame a tick by the clock, "
                     f"{cfg.lead_frames} frames ahead; a missed input is a tick that found "
                     f"none buffered. rtf: mean tick latency / tick length."}
