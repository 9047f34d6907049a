"""Turn-taking in `omnistage bench realtime`: how soon after a person stops speaking the server
decides that the turn ended, and how soon the answer's first audio follows.

    per mode        a session with one turn_detection the server offers (realtime/turn.py):
                    server_vad (its silence_duration_ms) or semantic_vad (its eagerness),
                    create_response on, so the server commits and answers by itself
    per repeat      a microphone: a speech-like utterance, then silence, in 20 ms pieces
                    (WebRTC's frames; coarser ones would add up to a piece to every figure),
                    each sent when its capture ends (in real time), until the answer's first
                    audio; the answer is then read to its response.done

        audio    |========= speech =========|- - - - - - - - - silence - - - - - - - - -
        sent       p    p    p    p    p    p    s    s    s    s    s    s    s    s    s
                                            |               |           |             |
                                      speech ends     stopped      committed     first audio
                                            |-- stopped_s --|
                                            |-- commit_s ---------------|
                                            |-- first_audio_s ------------------------|

    server          omnistage_realtime_turn_taking_seconds{decided_by} on /metrics, read
                    before and after the phase: the server's own speech_stopped -> commit
                    (silence: server_vad; score or max_wait: semantic_vad). It starts at
                    speech_stopped, so it leaves out the silence the detector waited for,
                    which commit_s counts (commit_s - stopped_s is the same span on the
                    clients' clock). Beside it omnistage_realtime_end_of_turn_score: the
                    scores semantic_vad's turns were judged by.

server_vad cannot commit before silence_duration_ms of silence has reached it, so its commit_s
is at least that. semantic_vad commits a short pause (high 64 ms, auto 96 ms, heard ~60 ms late)
plus one prefill into the silence when the model's end-of-turn score clears the eagerness's
threshold, or else at the eagerness's max wait (a random-weight model's score is about 0: the
max wait, 4 s for auto).
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from omnistage.benchmarks.common import summary
from omnistage.benchmarks.realtime_client import RATE, Session, open_session
from omnistage.testing.speech_like import pcm16, speech_like

MODES = ("server_vad", "semantic_vad")
CHUNK_S = 0.02               # a microphone's piece
MAX_SILENCE_S = 30.0         # the microphone stops sending after this much silence
HISTOGRAMS = ("omnistage_realtime_turn_taking_seconds", "omnistage_realtime_end_of_turn_score")
STOPPED, COMMITTED = "input_audio_buffer.speech_stopped", "input_audio_buffer.committed"
FIRST_AUDIO = "response.output_audio.delta"


@dataclass(frozen=True, slots=True)
class TurnTakingConfig:
    """The phase's modes and their parameters (the defaults are the server's own)."""
    modes: tuple[str, ...] = MODES        # (): no turn-taking phase
    repeats: int = 3                      # turns per mode
    silence_duration_ms: int = 500        # server_vad's (the server's default)
    eagerness: str = "auto"               # semantic_vad's (the server's default)

    def __post_init__(self) -> None:
        if not set(self.modes) <= set(MODES) or self.repeats < 1:
            raise ValueError(f"turn_taking modes={self.modes}, repeats={self.repeats}: modes "
                             f"among {MODES}, repeats >= 1")
        if not 32 <= self.silence_duration_ms <= 10000:
            raise ValueError(f"turn_taking silence_duration_ms={self.silence_duration_ms}: "
                             "must be 32..10000")
        if self.eagerness not in ("low", "medium", "high", "auto"):
            raise ValueError(f"turn_taking eagerness={self.eagerness!r}: choose low, medium, "
                             "high or auto")


def turn_detection(mode: str, cfg: TurnTakingConfig) -> dict[str, Any]:
    """The session's turn_detection for `mode`, at the config's parameters."""
    if mode == "server_vad":
        return {"type": "server_vad", "silence_duration_ms": cfg.silence_duration_ms,
                "create_response": True}
    assert mode == "semantic_vad", mode
    return {"type": "semantic_vad", "eagerness": cfg.eagerness, "create_response": True}


async def _microphone(s: Session, speech: np.ndarray, spoken: asyncio.Future[float]) -> None:
    """`speech`, then up to MAX_SILENCE_S of silence, in CHUNK_S pieces, each sent when its
    capture ends; `spoken` gets the time the last piece of speech went out."""
    step = int(RATE * CHUNK_S)
    silence = np.zeros(step, np.float32)
    start = time.perf_counter()
    for i in range(0, len(speech) + int(RATE * MAX_SILENCE_S), step):
        piece = speech[i:i + step] if i < len(speech) else silence
        captured = start + (i + len(piece)) / RATE
        await asyncio.sleep(max(0.0, captured - time.perf_counter()))
        await s.send("input_audio_buffer.append",
                     audio=base64.b64encode(pcm16(piece)).decode("ascii"))
        if i < len(speech) <= i + step:
            spoken.set_result(time.perf_counter())


async def _turn(s: Session, speech: np.ndarray) -> dict[str, float]:
    """One spoken turn under the session's turn detection: seconds from the end of speech to
    the speech_stopped before the commit, to the commit, and to the answer's first audio."""
    spoken: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    mic = asyncio.create_task(_microphone(s, speech, spoken))
    at: dict[str, float] = {}
    try:
        while FIRST_AUDIO not in at:
            ev, arrived = await s.next()
            if ev["type"] not in at or (ev["type"] == STOPPED and COMMITTED not in at):
                at[ev["type"]] = arrived     # the first of each, the last stop before commit
    finally:
        mic.cancel()
        await asyncio.gather(mic, return_exceptions=True)
    if not spoken.done() or at[COMMITTED] < spoken.result():
        raise RuntimeError("the turn was committed before the speech ended: the detector "
                           "split the utterance")
    assert STOPPED in at, f"a commit without speech_stopped: {sorted(at)}"
    await s.until("response.done")
    end = spoken.result()
    return {"stopped_s": at[STOPPED] - end, "commit_s": at[COMMITTED] - end,
            "first_audio_s": at[FIRST_AUDIO] - end}


async def _mode(url: str, model: str, detection: dict[str, Any], utterances: list[np.ndarray],
                answer_tokens: int) -> dict[str, Any]:
    """One session under `detection`, a turn per utterance, and their summaries."""
    s = await open_session(url, model, {"max_output_tokens": answer_tokens,
                                        "audio": {"input": {"turn_detection": detection}}})
    try:
        rows = [await _turn(s, speech) for speech in utterances]
    finally:
        await s.ws.close()
    return {"turn_detection": detection, "repeats": rows,
            **{key: summary([r[key] for r in rows]) for key in rows[0]},
            "stopped_to_commit_s": summary([r["commit_s"] - r["stopped_s"] for r in rows])}


async def server_histograms(url: str) -> dict[str, dict[str, dict[str, float]]]:
    """The server's realtime histograms from /metrics, {name: {label: {sum, count}}}: the
    turn-taking seconds by decided_by, and the end-of-turn scores (label "all")."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        text = (await http.get("/metrics")).text
    out: dict[str, dict[str, dict[str, float]]] = {name: {} for name in HISTOGRAMS}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, _, field = sample.name.rpartition("_")
            if name in out and field in ("sum", "count"):
                label = sample.labels.get("decided_by", "all")
                row = out[name].setdefault(label, {"sum": 0.0, "count": 0.0})
                row[field] += sample.value
    return out


def _since(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
           ) -> dict[str, dict[str, float]]:
    """What one histogram gained between two readings, with the mean, by label."""
    out = {}
    for label, now in after.items():
        was = before.get(label, {"sum": 0.0, "count": 0.0})
        count = now["count"] - was["count"]
        if count > 0:
            total = now["sum"] - was["sum"]
            out[label] = {"sum": total, "count": count, "mean": total / count}
    return out


async def measure(url: str, model: str, cfg: TurnTakingConfig, utterance_s: float,
                  answer_tokens: int, seed: int) -> dict[str, Any]:
    """Every mode of `cfg.modes` in turn (`cfg.repeats` utterances of `utterance_s`, answers
    of `answer_tokens`), the best of them (the lowest median commit_s) and what the server's
    histograms gained over the phase (`server`: by the metric's name less its
    omnistage_realtime_ prefix)."""
    utterances = [speech_like(utterance_s, rate=RATE, seed=seed + 300 + k)
                  for k in range(cfg.repeats)]
    before = await server_histograms(url)
    modes = {mode: await _mode(url, model, turn_detection(mode, cfg), utterances, answer_tokens)
             for mode in cfg.modes}
    after = await server_histograms(url)
    best = min(modes, key=lambda m: modes[m]["commit_s"]["median"]) if modes else None
    return {"modes": modes, "best_mode": best,
            "server": {name.removeprefix("omnistage_realtime_"): _since(before[name], after[name])
                       for name in HISTOGRAMS}}


def headline(turns: dict[str, Any]) -> dict[str, float | None]:
    """turn_taking_s (the best mode's median end of speech to commit) and
    turn_taking_first_audio_s (its median to the first audio), and each mode's commit_s."""
    best = turns["modes"].get(turns["best_mode"]) if turns["best_mode"] else None
    out = {"turn_taking_s": best["commit_s"]["median"] if best else None,
           "turn_taking_first_audio_s": best["first_audio_s"]["median"] if best else None}
    out.update({f"turn_taking_s_{mode}": row["commit_s"]["median"]
                for mode, row in turns["modes"].items()})
    return out
