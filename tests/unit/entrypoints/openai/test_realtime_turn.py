"""semantic_vad's end-of-turn decision (realtime/turn.py) without a model: the score is a stand-in
scorer's, Silero hears speech-like audio (omnistage/testing/speech_like.py), and a
RealtimeConnection runs in-process over a stand-in socket (paced: a score in the background
answers between two appends). A high score ends the turn within 0.2 s of the end of speech on
the audio's own timeline; a low one waits for the eagerness's max wait (by the audio, or by the
clock when the client stops sending), scored again as the pause grows; speech again keeps the
same turn going, a short pause saying nothing and committing nothing. And the open-turn prompt
the served model scores is the response's own prompt up to its end-of-turn token."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from starlette.websockets import WebSocketState

from omnistage.entrypoints.openai.metrics import ServerMetrics
from omnistage.entrypoints.openai.realtime.audio_buffer import samples_to_ms
from omnistage.entrypoints.openai.realtime.connection import RealtimeConnection, RealtimeLimits
from omnistage.entrypoints.openai.realtime.protocol import LISTEN_RATE
from omnistage.entrypoints.openai.realtime.turn import (EAGERNESS, END_OF_TURN, SILENCE_MS,
                                                        EndOfTurn, end_of_turn_probability,
                                                        open_turn_prompt)
from omnistage.testing.speech_like import pcm16, speech_like

MODEL = "tiny-omni"
RATE = 24000
PACE_S = 0.005           # between two client events: a score answers in less


class Socket:
    """The server side of a WebSocket: the client's frames in order, `PACE_S` apart, then
    (after `linger_s` of a client that sends nothing more) a disconnect. Each event sent
    notes `heard_ms`: the audio the server had received when it sent it."""

    def __init__(self, events: list[dict[str, Any]], linger_s: float = 0.0) -> None:
        self.incoming = [{"type": "websocket.receive", "text": json.dumps(e)} for e in events]
        self.linger_s = linger_s
        self.sent: list[dict[str, Any]] = []
        self.heard: Any = lambda: 0
        self.application_state = WebSocketState.CONNECTED
        self.query_params = {"model": MODEL}

    async def accept(self) -> None:
        pass

    async def receive(self) -> dict[str, Any]:
        if self.incoming:
            await asyncio.sleep(PACE_S)
            return self.incoming.pop(0)
        await asyncio.sleep(self.linger_s)
        return {"type": "websocket.disconnect"}

    async def send_text(self, text: str) -> None:
        self.sent.append(json.loads(text) | {"heard_ms": self.heard()})

    async def close(self, code: int = 1000) -> None:
        self.application_state = WebSocketState.DISCONNECTED


class FixedScore:
    """A scorer that says the same each time, and what it was asked about."""

    def __init__(self, value: float | None) -> None:
        self.value = value
        self.audio_ms: list[int] = []
        self.conn: Any = None            # the session it scores for

    async def score(self, messages: list[dict[str, Any]], audio: np.ndarray) -> float | None:
        self.audio_ms.append(len(audio) * 1000 // LISTEN_RATE)
        return self.value


def talk(*pieces: tuple[str, float], step_s: float = 0.1, seed: int = 0
         ) -> list[dict[str, Any]]:
    """Appends (`step_s` each, 24 kHz) of ("speech" | "silence", seconds) pieces in order.
    (Silero hears some seeds' utterances dip for 64 ms inside: the tests that need none
    choose a seed without.)"""
    audio = np.concatenate([speech_like(s, rate=RATE, seed=seed + i) if kind == "speech"
                            else np.zeros(int(s * RATE), np.float32)
                            for i, (kind, s) in enumerate(pieces)])
    step = int(RATE * step_s)
    return [{"type": "input_audio_buffer.append",
             "audio": base64.b64encode(pcm16(audio[i:i + step])).decode("ascii")}
            for i in range(0, len(audio), step)]


def run(score: float | None | Any, eagerness: str, events: list[dict[str, Any]],
        linger_s: float = 0.0) -> tuple[RealtimeConnection, list[dict[str, Any]], Any]:
    """The events through a session under semantic_vad at `eagerness`, scored by a
    FixedScore(`score`) (or by `score` itself, a scorer); the events sent after the
    session's, and the scorer."""
    detection = {"type": "semantic_vad", "eagerness": eagerness, "create_response": False}
    ws = Socket([{"type": "session.update", "session": {"audio": {"input": {
        "turn_detection": detection}}}}, *events], linger_s)
    client = SimpleNamespace(processor=SimpleNamespace(input_modalities=("text", "audio")),
                             outputs={"text", "audio"}, max_model_len=None,
                             metrics=ServerMetrics(MODEL),
                             engine=SimpleNamespace(audio_sample_rate=24000))
    conn = RealtimeConnection(ws, client, MODEL, RealtimeLimits())   # type: ignore[arg-type]
    scorer = score if isinstance(score, FixedScore) else FixedScore(score)
    conn.turns.scorer = scorer
    scorer.conn = conn
    ws.heard = lambda: samples_to_ms(conn.buffer.end)
    asyncio.run(conn.run())
    assert not [e for e in ws.sent if e["type"] == "error"], ws.sent
    assert ws.sent[1]["session"]["audio"]["input"]["turn_detection"] == detection | {
        "interrupt_response": True}
    return conn, ws.sent[2:], scorer


def kinds(sent: list[dict[str, Any]]) -> list[str]:
    return [e["type"].removeprefix("input_audio_buffer.") for e in sent
            if e["type"].startswith("input_audio_buffer.")]


def decided(conn: RealtimeConnection, by: str) -> float:
    value = conn.client.metrics.registry.get_sample_value(
        "omnistage_realtime_turn_taking_seconds_count", {"decided_by": by})
    return value or 0.0


@pytest.mark.parametrize("eagerness", ["high", "auto", "low"])
def test_a_high_score_ends_the_turn_soon_after_the_speech(eagerness: str) -> None:
    """Speech ends at 1300 ms; 20 ms appends as a microphone sends. The first score comes
    after the eagerness's pause (Silero hears it about 60 ms late), and ends the turn: on the
    audio's timeline the commit comes within 0.2 s of the end of speech (high, auto)."""
    pause = EAGERNESS[eagerness].pause_ms
    conn, sent, scorer = run(0.9, eagerness, talk(("silence", 0.3), ("speech", 1.0),
                                                  ("silence", 0.6), step_s=0.02, seed=2))
    assert kinds(sent) == ["speech_started", "speech_stopped", "committed"]
    started, stopped, committed = sent[0], sent[1], sent[2]
    assert stopped["item_id"] == started["item_id"] == committed["item_id"]
    assert 1300 + pause - 100 <= stopped["audio_end_ms"] <= 1300 + pause + 100
    # the audio the server had when it committed: the pause and the score's time
    assert committed["heard_ms"] - 1300 <= pause + 120
    if eagerness != "low":
        assert committed["heard_ms"] - 1300 <= 200
    # the model was asked about the turn's audio: its speech (with the padding, less what
    # the buffer dropped before the 20 ms append holding the onset) and the pause, committed
    [item] = conn.conversation.items
    assert scorer.audio_ms == [len(item.parts[0].audio) * 1000 // LISTEN_RATE]
    span = stopped["audio_end_ms"] - started["audio_start_ms"]
    assert span - 40 <= scorer.audio_ms[0] <= span
    assert decided(conn, "score") == 1 and decided(conn, "max_wait") == 0


@pytest.mark.parametrize("score", [0.1, None])
def test_a_low_score_waits_for_the_eagerness_max_wait(score: float | None) -> None:
    """high: 2 s of silence at most; 1.5 s is not enough, 2.5 s is (a missing score too).
    speech_stopped is said at 200 ms of silence, and the pause is scored again each time it
    has doubled."""
    assert EAGERNESS["high"].max_wait_ms == 2000
    _, sent, scorer = run(score, "high", talk(("speech", 1.0), ("silence", 1.5)))
    assert kinds(sent) == ["speech_started", "speech_stopped"]
    assert 1000 + SILENCE_MS - 100 <= sent[1]["audio_end_ms"] <= 1000 + SILENCE_MS + 100
    pauses = [ms - scorer.audio_ms[0] for ms in scorer.audio_ms]
    assert 3 <= len(pauses) <= 5, scorer.audio_ms          # 64, 128, 256, 512, 1024 ms
    assert all(later >= 2 * sooner for sooner, later in zip(pauses[1:], pauses[2:])), pauses
    conn, sent, _ = run(score, "high", talk(("speech", 1.0), ("silence", 2.5)))
    assert kinds(sent) == ["speech_started", "speech_stopped", "committed"]
    assert decided(conn, "max_wait") == 1 and decided(conn, "score") == 0


def test_the_max_wait_runs_on_the_clock_when_the_client_stops_sending() -> None:
    """Speech then 0.4 s of silence (sent faster than real time), then nothing: the clock
    counts the rest of the 2 s from the last audio on."""
    conn, sent, _ = run(0.0, "high", talk(("speech", 1.0), ("silence", 0.4)), linger_s=2.5)
    assert kinds(sent) == ["speech_started", "speech_stopped", "committed"]
    assert decided(conn, "max_wait") == 1
    seconds = conn.client.metrics.registry.get_sample_value(
        "omnistage_realtime_turn_taking_seconds_sum", {"decided_by": "max_wait"})
    # from speech_stopped (200 ms into the silence) to the commit: the 2 s less the silence
    # the audio held (0.4 s, and Silero's early mark of the end: up to 0.1 s), plus slack
    assert EAGERNESS["high"].max_wait_ms / 1000 - 0.5 - 0.05 <= seconds <= 2.3


def test_speech_resuming_keeps_the_turn_going() -> None:
    """A pause judged not the end (low score), then more speech: the same item goes on, its
    audio holding both, and it ends at the max wait after the second pause."""
    conn, sent, scorer = run(0.1, "high", talk(("speech", 1.0), ("silence", 0.6),
                                               ("speech", 0.8), ("silence", 2.5)))
    assert kinds(sent) == ["speech_started", "speech_stopped", "speech_started",
                           "speech_stopped", "committed"]
    assert len({e["item_id"] for e in sent if e["type"].startswith("input_audio_buffer.")}) == 1
    assert scorer.audio_ms[-1] > scorer.audio_ms[0] + 1000
    [item] = conn.conversation.items
    assert len(item.parts[0].audio) >= int(2.4 * LISTEN_RATE)


class SureOnceSpeechResumed(FixedScore):
    """Sure the turn ended (1.0); its first answer comes only once the user speaks again."""

    def __init__(self) -> None:
        super().__init__(1.0)

    async def score(self, messages: list[dict[str, Any]], audio: np.ndarray) -> float | None:
        await super().score(messages, audio)
        deadline = time.monotonic() + 10
        while len(self.audio_ms) == 1 and not self.conn.vad.speaking:
            assert time.monotonic() < deadline, "the speech never resumed"
            await asyncio.sleep(0.001)
        return self.value


def test_a_pause_shorter_than_the_threshold_is_not_judged() -> None:
    """Two utterances back to back: the dip between them is under high's 64 ms of silence
    as Silero hears it, so a sure scorer is asked once, at the end, and the turn is both."""
    conn, sent, scorer = run(1.0, "high", talk(("speech", 1.0), ("speech", 0.8),
                                               ("silence", 0.6), step_s=0.02, seed=3))
    assert kinds(sent) == ["speech_started", "speech_stopped", "committed"]
    assert len(scorer.audio_ms) == 1 and scorer.audio_ms[0] >= 1800
    [item] = conn.conversation.items
    assert len(item.parts[0].audio) >= int(1.8 * LISTEN_RATE)


def test_speech_resuming_while_a_score_runs_commits_nothing() -> None:
    """A 30 ms gap (Silero hears ~100 ms of silence, over high's 64) is scored; the user
    speaks again before the score is back, then it says 'done': dropped. No speech_stopped,
    no commit; one turn, ended by the score of the pause after the second utterance."""
    scorer = SureOnceSpeechResumed()
    conn, sent, _ = run(scorer, "high", talk(("speech", 1.0), ("silence", 0.03),
                                             ("speech", 0.8), ("silence", 0.6), step_s=0.02,
                                             seed=0))
    assert kinds(sent) == ["speech_started", "speech_stopped", "committed"]
    assert sent[1]["audio_end_ms"] >= 1830
    assert len(scorer.audio_ms) == 2 and scorer.audio_ms[0] < 1200 < 1800 < scorer.audio_ms[1]
    [item] = conn.conversation.items
    assert len(item.parts[0].audio) >= int(1.8 * LISTEN_RATE)
    assert decided(conn, "score") == 1


def test_the_decision_alone() -> None:
    """EndOfTurn with the times given: the threshold, the scores as the pause doubles, the
    max wait by audio and by clock."""
    decision = EndOfTurn(EAGERNESS["medium"])
    decision.stopped("a", end_ms=1100, silence_ms=100, now=10.0)
    assert decision.judge(0.5) and decision.pending is None        # medium: 0.5 ends it
    pending = decision.stopped("b", end_ms=1100, silence_ms=100, now=10.0)
    assert pending.speech_end_ms == 1000 and pending.quiet_since == pytest.approx(9.9)
    assert decision.scoring(1100) and not decision.scoring(1150)    # next at 200 ms of pause
    assert decision.scoring(1230) and pending.next_score_ms == 460
    assert not decision.judge(0.49) and decision.pending is pending
    assert not decision.due(audio_ms=1000 + 3999, now=10.1)
    assert decision.due(audio_ms=1000 + 4000, now=10.1) and decision.pending is None
    decision.stopped("c", end_ms=1100, silence_ms=100, now=10.0)
    assert not decision.judge(None)
    assert not decision.due(audio_ms=1300, now=10.0 + 3.89)
    assert decision.due(audio_ms=1300, now=10.0 + 3.9)             # 4 s less the 100 ms
    decision.stopped("d", end_ms=1100, silence_ms=100, now=10.0)
    assert decision.resumed().item_id == "d" and decision.resumed() is None


def test_end_of_turn_probability() -> None:
    assert end_of_turn_probability([{2: np.log(0.25), 7: np.log(0.5)}], 2) == pytest.approx(0.25)
    assert end_of_turn_probability([{7: -0.1}], 2) == 0.0          # outside the top 20
    assert end_of_turn_probability(None, 2) is None


def test_a_bad_eagerness_is_refused_and_the_session_goes_on() -> None:
    ws = Socket([{"type": "session.update", "event_id": "e1", "session": {"audio": {"input": {
        "turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}}},
        {"type": "session.update", "session": {"audio": {"input": {
            "turn_detection": {"type": "semantic_vad", "eagerness": "high"}}}}}])
    client = SimpleNamespace(processor=SimpleNamespace(input_modalities=("text", "audio")),
                             outputs={"text", "audio"}, max_model_len=None, metrics=None,
                             engine=SimpleNamespace(audio_sample_rate=24000))
    asyncio.run(RealtimeConnection(ws, client, MODEL, RealtimeLimits()).run())  # type: ignore
    error = ws.sent[1]["error"]
    assert error["param"] == "session.audio.input.turn_detection.eagerness"
    assert error["event_id"] == "e1"
    assert ws.sent[2]["type"] == "session.updated"
    assert ws.sent[2]["session"]["audio"]["input"]["turn_detection"]["eagerness"] == "high"


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from omnistage.engine.inputs import load_input_processor
    from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

    path: Path = build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny_omni"))
    return load_input_processor(path)


def test_the_open_turn_is_the_responses_prompt_up_to_its_end(processor: Any) -> None:
    """The prompt scored is the one the response then sends, cut before <|im_end|>: same
    ids, same audio features, so the prefix cache carries one into the other."""
    earlier = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": [{"type": "audio",
                                             "audio": (speech_like(0.7, seed=1), LISTEN_RATE)}]},
               {"role": "assistant", "content": "Sure."}]
    audio = speech_like(1.1, seed=2)
    prompt = open_turn_prompt(processor.tokenizer, processor.placeholders["audio"], earlier,
                              audio)
    opened = processor.parse_request(prompt)
    closed = processor.parse_request({"messages": [*earlier, {"role": "user", "content": [
        {"type": "audio", "audio": (audio, LISTEN_RATE)}]}]})
    ids, full = opened.input_ids.tolist(), closed.input_ids.tolist()
    end = processor.tokenizer.convert_tokens_to_ids(END_OF_TURN)
    assert full[:len(ids)] == ids and full[len(ids)] == end
    assert ids[-1] == processor.tokenizer.convert_tokens_to_ids("<|audio_end|>")
    assert np.array_equal(opened.input_features.numpy(), closed.input_features.numpy())


def test_a_score_that_comes_too_late_is_abandoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy engine's score past SCORE_TIMEOUT_S: the turn goes unscored (None, decided by
    its silence) and the score request is closed, not left running."""
    from omnistage.entrypoints.openai.realtime import turn

    closed: list[bool] = []

    class Stuck:
        def request(self, *args: Any, **kw: Any) -> object:
            return object()

        async def generate(self, requests: list) -> Any:
            try:
                await asyncio.sleep(60)
                yield None
            finally:
                closed.append(True)

    monkeypatch.setattr(turn, "SCORE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(turn, "open_turn_prompt", lambda *a: "prompt")
    scorer = turn.ModelScorer(Stuck(), None, "<|audio_pad|>", 7)     # type: ignore[arg-type]
    t0 = time.monotonic()
    got = asyncio.run(scorer.score([], np.zeros(160, np.float32)))
    assert got is None and time.monotonic() - t0 < 5
    assert closed == [True]
