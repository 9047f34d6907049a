"""Voice conversation over WebSocket /v1/realtime: a real `omnistage serve` of the Qwen3-Omni
benchmark model (omni.py's random-weight checkpoint of the real layer structure), talked to by
clients that speak as the protocol's apps do.

    per session     session.update (manual turn detection, speech out, thinker_tokens a
                    turn), then `turns` spoken turns: a 2 s utterance (speech-like audio,
                    testing/speech_like.py, PCM16 at 24 kHz undeclared, as OpenAI's apps send
                    it) appended, committed, response.create; the answer
                    read to its response.done
    first audio     seconds from sending input_audio_buffer.commit to the first
                    response.output_audio.delta: what a person waits for after speaking
                    (realtime_first_audio_s_c1 / _c8: the median over every turn at 1 session,
                    at 8 sessions speaking at once)
    prefix cache    each turn's input tokens and the part the prefix cache served (the
                    conversation so far): the prefill a turn saves
    barge-in        a session with server VAD: while the answer streams, 1 s of speech is sent
                    in real-time 100 ms pieces; from its first piece to speech_started
                    (detection), and from speech_started to response.done with status
                    cancelled, and the two together; and from speech_started until no stage
                    holds the answer any more (polled on /metrics)
    turn-taking     realtime_turns.py: per turn_detection mode, from the end of speech
                    (sent in real time, silence after it) to the commit and to the first
                    audio (turn_taking_s: the best mode's median to the commit)

The server's thinker is greedy and ignores eos, so every answer is exactly thinker_tokens long;
the talker stops at its codec eos or talker_tokens frames.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from omnistage.benchmarks import realtime_turns
from omnistage.benchmarks.common import environment, free_device_memory, summary
from omnistage.benchmarks.realtime_client import RATE, TURN_TIMEOUT_S, open_session
from omnistage.benchmarks.realtime_turns import TurnTakingConfig
from omnistage.testing.processes import free_port
from omnistage.testing.speech_like import speech_like
from omnistage.utils.device import resolve_device

MODEL = "qwen3-omni-bench"
START_TIMEOUT_S = 900


@dataclass(frozen=True, slots=True)
class RealtimeBenchConfig:
    sizes: str = "bench"                      # bench | tiny (omni.py's checkpoints)
    concurrency: tuple[int, ...] = (1, 8)
    turns: int = 3                            # spoken turns per session
    utterance_s: float = 2.0
    thinker_tokens: int = 32                  # text tokens of each answer
    talker_tokens: int = 200                  # codec frames at most (12.5 a second): random
                                              # weights rarely say their codec eos
    barge_ins: int = 3
    turn_taking: TurnTakingConfig = TurnTakingConfig()
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sizes not in ("bench", "tiny"):
            raise ValueError(f"sizes={self.sizes!r}: choose bench or tiny")
        if (min(self.turns, self.thinker_tokens, self.talker_tokens, self.barge_ins) < 1
                or self.utterance_s <= 0):
            raise ValueError("turns, thinker_tokens, talker_tokens, barge_ins and utterance_s "
                             "must be positive")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency={self.concurrency}: need values >= 1")


class Server:
    """`omnistage serve` of the checkpoint in a subprocess, on a free port."""

    def __init__(self, path: Path, device: str, talker_tokens: int, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "omnistage.entrypoints.cli.main", "serve", str(path),
               "--served-model-name", MODEL, "--port", str(self.port), "--device", device,
               "--log-level", "warning",
               "--stage-override", "thinker.ar.sampling.temperature=0",
               "--stage-override", "thinker.ar.sampling.ignore_eos=true",
               "--stage-override", f"talker.ar.sampling.max_tokens={talker_tokens}"]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: see "
                                   f"{self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server was not ready in {START_TIMEOUT_S} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


async def _turns(url: str, model: str, cfg: RealtimeBenchConfig, idx: int,
                 start: asyncio.Barrier) -> list[dict[str, float | int]]:
    """One session's spoken turns (all sessions commit each turn together)."""
    s = await open_session(url, model, {"max_output_tokens": cfg.thinker_tokens,
                                        "audio": {"input": {"turn_detection": None}}})
    rows = []
    try:
        for turn in range(cfg.turns):
            await s.speak(speech_like(cfg.utterance_s, rate=RATE,
                                      seed=cfg.seed + 100 * idx + turn))
            await start.wait()
            committed = time.perf_counter()
            await s.send("input_audio_buffer.commit")
            await s.send("response.create")
            _, first = await s.until("response.output_audio.delta")
            done, end = await s.until("response.done")
            usage = done["response"]["usage"]
            rows.append({"first_audio_s": first - committed, "turn_s": end - committed,
                         "input_tokens": usage["input_tokens"],
                         "cached_tokens": usage["input_token_details"]["cached_tokens"],
                         "audio_tokens": usage["output_token_details"]["audio_tokens"]})
    finally:
        await s.ws.close()
    return rows


async def _barge_in(url: str, model: str, cfg: RealtimeBenchConfig) -> dict[str, float]:
    """Speech over a streaming answer: detection, then cancellation through every stage."""
    s = await open_session(url, model, {"max_output_tokens": 4096, "audio": {"input": {
        "turn_detection": {"type": "server_vad", "silence_duration_ms": 500,
                           "create_response": False}}}})
    try:
        await s.send("conversation.item.create", item={"type": "message", "role": "user",
                     "content": [{"type": "input_text", "text": "Tell me a long story."}]})
        await s.send("response.create")
        await s.until("response.output_audio.delta")
        await s.speak(np.zeros(RATE, np.float32), real_time=False)      # VAD warm, silent
        sent = time.perf_counter()
        speaking = asyncio.create_task(s.speak(speech_like(1.0, rate=RATE, seed=cfg.seed + 7),
                                               real_time=True))
        _, detected = await s.until("input_audio_buffer.speech_started")
        done, cancelled = await s.until("response.done")
        released = await _stages_released(url)
        await speaking
        assert done["response"]["status"] == "cancelled", done["response"]["status"]
    finally:
        await s.ws.close()
    return {"detect_s": detected - sent, "cancel_s": cancelled - detected,
            "barge_in_s": cancelled - sent, "stages_released_s": released - detected}


async def _stages_released(url: str) -> float:
    """When every stage holds no request any more (the abort reached them all), polled on
    /metrics: the time of the first answer saying so."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        deadline = time.perf_counter() + TURN_TIMEOUT_S
        while time.perf_counter() < deadline:
            text = (await http.get("/metrics")).text
            now = time.perf_counter()
            held = sum(sample.value for fam in text_string_to_metric_families(text)
                       for sample in fam.samples if sample.name == "omnistage_stage_queue_length")
            if held == 0:
                return now
    raise TimeoutError("a stage still holds the cancelled answer")


async def measure(url: str, model: str, cfg: RealtimeBenchConfig) -> dict[str, Any]:
    """The clients' side against a server at `url` serving `model`: every concurrency's turns,
    the barge-ins, then turn-taking (realtime_turns.py)."""
    by_c: dict[str, Any] = {}
    for c in cfg.concurrency:
        barrier = asyncio.Barrier(c)
        sessions = await asyncio.gather(*(_turns(url, model, cfg, i, barrier)
                                          for i in range(c)))
        rows = [r for s in sessions for r in s]
        later = [r for s in sessions for r in s[1:]]
        by_c[str(c)] = {
            "sessions": c, "turns": len(rows),
            "first_audio_s": summary([r["first_audio_s"] for r in rows]),
            "first_audio_s_first_turn": summary([s[0]["first_audio_s"] for s in sessions]),
            "turn_s": summary([r["turn_s"] for r in rows]),
            "cached_fraction_later_turns": (sum(r["cached_tokens"] for r in later)
                                            / max(1, sum(r["input_tokens"] for r in later))),
            "rows": sessions}
    barge = [await _barge_in(url, model, cfg) for _ in range(cfg.barge_ins)]
    return {"by_concurrency": by_c,
            "barge_in": {k: summary([b[k] for b in barge]) for k in barge[0]},
            "turn_taking": await realtime_turns.measure(url, model, cfg.turn_taking,
                                                        cfg.utterance_s, cfg.thinker_tokens,
                                                        cfg.seed)}


def headline(ours: dict[str, Any], cfg: RealtimeBenchConfig) -> dict[str, float | None]:
    """The JSON's `ratios`: medians in seconds, and the prefix cache's share."""
    by_c, barge = ours["by_concurrency"], ours["barge_in"]
    out = {f"realtime_first_audio_s_c{c}": by_c[str(c)]["first_audio_s"]["median"]
           for c in cfg.concurrency}
    out.update({"realtime_barge_in_s": barge["barge_in_s"]["median"],
                "realtime_barge_in_cancel_s": barge["cancel_s"]["median"],
                "realtime_barge_in_stages_released_s": barge["stages_released_s"]["median"]})
    out.update({f"realtime_cached_fraction_c{c}": by_c[str(c)]["cached_fraction_later_turns"]
                for c in cfg.concurrency})
    out.update(realtime_turns.headline(ours["turn_taking"]))
    return out


def run(cfg: RealtimeBenchConfig) -> dict[str, object]:
    from omnistage.benchmarks.omni import build_checkpoint

    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-realtime-") as tmp:
        path = Path(tmp) / "qwen3-omni"
        build_checkpoint(cfg.sizes, path, device, dtype)    # its model is dropped: the server
        free_device_memory(device)                          # loads the saved folder
        server = Server(path, str(device), cfg.talker_tokens, Path(tmp) / "server.log")
        try:
            t0 = time.perf_counter()
            server.wait_ready()
            startup = time.perf_counter() - t0
            warm = replace(cfg, concurrency=(1,), turns=1, utterance_s=0.5, thinker_tokens=4,
                           barge_ins=1, turn_taking=replace(cfg.turn_taking, repeats=1))
            asyncio.run(measure(server.url, MODEL, warm))       # first steps, first VAD
            ours = asyncio.run(measure(server.url, MODEL, cfg))
        except BaseException:
            server.stop()
            print(Path(tmp, "server.log").read_text()[-4000:], file=sys.stderr)
            raise
        server.stop()
    ratios = headline(ours, cfg)
    return {"benchmark": "realtime", **environment(device),
            "dtype": str(dtype).removeprefix("torch."), "config": asdict(cfg),
            "startup_s": startup, "omnistage": ours, "ratios": ratios,
            "notes": "first_audio: seconds from input_audio_buffer.commit to the first "
                     "response.output_audio.delta (median over every turn of every session; "
                     "the sessions of a concurrency commit each turn together). "
                     "cached_fraction: of the input tokens of turns after the first, the "
                     "share the prefix cache served. barge_in: from the first 100 ms piece of "
                     "speech sent over a streaming answer to its response.done (cancelled); "
                     "detect_s to speech_started, cancel_s from there to response.done, "
                     "stages_released_s from there until /metrics shows no stage holding a "
                     "request (an upper bound: one /metrics round trip asks every stage). "
                     "turn_taking: per turn_detection mode, from the last 20 ms piece of "
                     "speech sent in real time (silence follows, also in real time) to "
                     "input_audio_buffer.committed (commit_s) and to the first "
                     "response.output_audio.delta (first_audio_s); turn_taking_s is the "
                     "median commit_s of best_mode, the mode with the lowest; server: the "
                     "server's own omnistage_realtime_turn_taking_seconds over the phase "
                     "(from speech_stopped, so without the silence waited for)."}
