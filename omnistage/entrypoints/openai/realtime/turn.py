"""Turn-taking on a realtime session: what Silero's speech start / stop (vad.py) do under the
session's `turn_detection`.

    server_vad     speech_stopped after silence_duration_ms   -> the turn ends (committed)
    semantic_vad   a pause (Silero silent for the eagerness's pause_ms) -> the turn is judged
                   (in the background, the audio going on):
                     score >= the eagerness's threshold -> it ends now (stopped, committed)
                     lower, or no score       -> judged again each time the pause doubles
                     the pause reaches 200 ms -> speech_stopped is said (SILENCE_MS), still open
                     the silence reaches the eagerness's max wait -> it ends then
                     speech again before that -> the same turn goes on (a score in flight is
                                    dropped); speech_started only if speech_stopped was said

    eagerness      low    medium / auto    high
    pause          160    96               64 ms    (of silence before the first score)
    threshold      0.8    0.5              0.3      (the score that ends a turn at once)
    max wait       8 s    4 s              2 s      (of silence; OpenAI's documented waits)

A confident model ends a turn a pause plus one prefill after the speech (Silero marks the end
~60 ms late), the events in the protocol's order: speech_started, speech_stopped, committed. A
pause not judged final, then speech, sends nothing (the client never heard the turn stop).
speech_stopped's audio_end_ms ends the audio the turn commits, the silence heard included.

The score is a `TurnScorer`'s: `ModelScorer` asks the served model itself, one prefill
through the engine of the conversation with the user's audio in an open turn (rendered up to
the audio, the turn not closed), for the probability of its end-of-turn token (`<|im_end|>`)
next. That prompt is a prefix of the response's own, so the prefix cache serves it the
earlier turns. (Not yet the other way: a text-only request's thinker emits no hidden rows for
the talker, so the response, which needs them, cannot hit the blocks the score computed.)
The engine returns the top-20 logprobs of a position: an end-of-turn token outside them has a
probability under the 20th's (at most 1/20), read as 0, which decides as the true value would
against every threshold above. A model without that (no audio placeholder, no ChatML end
token) gets `SilenceOnly`: no score, so each turn ends at its eagerness's max wait.

The max wait counts the session's audio (the silence appended after the speech) and, for a
client that stops sending, the wall clock from its last audio on. `/metrics` gets
omnistage_realtime_turn_taking_seconds{decided_by}: speech_stopped to the commit (silence:
server_vad; score: about 0 when the first scores end the turn before 200 ms, as speech_stopped
is said with the commit; max_wait; max_turn: a turn cut at the session's length limit), and
omnistage_realtime_end_of_turn_score (every score, the later ones of a pause included).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from starlette.concurrency import run_in_threadpool

from omnistage.engine.request import RequestFields
from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.realtime.audio_buffer import ms_to_samples, samples_to_ms
from omnistage.entrypoints.openai.realtime.protocol import (LISTEN_RATE, SemanticVad,
                                                            ServerVad, error_event, event,
                                                            new_id)
from omnistage.entrypoints.openai.realtime.vad import VadEvent

if TYPE_CHECKING:
    from omnistage.entrypoints.openai.client import EngineClient

logger = logging.getLogger(__name__)

SILENCE_MS = 200         # semantic_vad: the pause after which speech_stopped is said
PADDING_MS = 300         # semantic_vad: audio kept before the detected speech (server_vad's)
SILERO_THRESHOLD = 0.5
TOP_LOGPROBS = 20        # the most the engine returns (OpenAI's top_logprobs limit)
END_OF_TURN = "<|im_end|>"
# A score later than this is no use to a turn that waits at most seconds: the turn goes
# unscored (decided by its silence), and the score request is abandoned.
SCORE_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class Eagerness:
    threshold: float     # an end-of-turn score this high ends the turn at once
    max_wait_ms: int     # silence this long ends it whatever the score
    pause_ms: int        # silence this long is first judged (Silero's frames: 32 ms each)


EAGERNESS = {"low": Eagerness(0.8, 8000, 160), "medium": Eagerness(0.5, 4000, 96),
             "auto": Eagerness(0.5, 4000, 96), "high": Eagerness(0.3, 2000, 64)}


def silero_settings(vad: ServerVad | SemanticVad) -> tuple[float, int, int]:
    """(threshold, silence ms, prefix padding ms) of the Silero detector a session runs."""
    if isinstance(vad, ServerVad):
        return vad.threshold, vad.silence_duration_ms, vad.prefix_padding_ms
    return SILERO_THRESHOLD, EAGERNESS[vad.eagerness].pause_ms, PADDING_MS


# -- the score ------------------------------------------------------------------------------

class TurnScorer(Protocol):
    async def score(self, messages: list[dict[str, Any]], audio: np.ndarray) -> float | None:
        """The probability that the user is done, after the conversation's `messages` and
        the user's `audio` (float32 at LISTEN_RATE) in an open turn; None: no score."""
        ...


class SilenceOnly:
    """No score: silence alone ends a turn, at the eagerness's max wait."""

    async def score(self, messages: list[dict[str, Any]], audio: np.ndarray) -> float | None:
        return None


def open_turn_prompt(tokenizer: Any, audio_placeholder: str, messages: list[dict[str, Any]],
                     audio: np.ndarray) -> dict[str, Any]:
    """The chat prompt of `messages` plus a user turn holding `audio`, rendered up to the
    audio with the turn left open (the closed prompt less its end-of-turn token), as the
    front door's {"prompt", "multi_modal_data"} form; ValueError for a template whose
    turns do not close with END_OF_TURN."""
    turn = {"role": "user", "content": [{"type": "audio", "audio": (audio, LISTEN_RATE)}]}
    conversation, audios = [], []
    for message in [*messages, turn]:
        content = message["content"]
        if not isinstance(content, str):
            texts = []
            for part in content:
                if part["type"] == "audio":
                    audios.append(part["audio"])
                    texts.append(audio_placeholder)
                else:
                    texts.append(part["text"])
            content = "".join(texts)
        conversation.append({"role": message["role"], "content": content})
    closed = tokenizer.apply_chat_template(conversation, tokenize=False,
                                           add_generation_prompt=False).rstrip()
    if not closed.endswith(END_OF_TURN):
        raise ValueError(f"the chat template does not close a turn with {END_OF_TURN}")
    return {"prompt": closed[:-len(END_OF_TURN)], "multi_modal_data": {"audio": audios}}


def end_of_turn_probability(logprobs: list[dict[int, float]] | None, token_id: int
                            ) -> float | None:
    """The first generated position's probability of `token_id` (0 outside the top logprobs
    returned); None when no logprobs came back."""
    if not logprobs:
        return None
    lp = logprobs[0].get(token_id)
    return 0.0 if lp is None else math.exp(lp)


class ModelScorer:
    """The served model's own end-of-turn prediction (module docstring)."""

    FIELDS = RequestFields({"max_tokens": 1, "temperature": 0.0, "logprobs": TOP_LOGPROBS})

    def __init__(self, client: EngineClient, tokenizer: Any, audio_placeholder: str,
                 token_id: int) -> None:
        self.client, self.tokenizer = client, tokenizer
        self.placeholder, self.token_id = audio_placeholder, token_id

    @classmethod
    def of(cls, client: EngineClient) -> ModelScorer | None:
        """The scorer of a model whose input processor declares an audio placeholder and
        whose tokenizer has END_OF_TURN (Qwen3-Omni's); None for any other."""
        processor = client.processor
        placeholders = getattr(processor, "placeholders", None)   # Qwen3-Omni's processor
        if not isinstance(placeholders, dict) or "audio" not in placeholders:
            return None
        tokenizer = processor.tokenizer
        token_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
            return None
        return cls(client, tokenizer, placeholders["audio"], token_id)

    async def _last(self, request: Any) -> Any:
        last = None
        async for out in self.client.generate([request]):
            last = out
        return last

    async def score(self, messages: list[dict[str, Any]], audio: np.ndarray) -> float | None:
        try:
            prompt = await run_in_threadpool(open_turn_prompt, self.tokenizer, self.placeholder,
                                             messages, audio)
            request = self.client.request(prompt, self.FIELDS, {"text"}, "eot",
                                          param="conversation")
            last = await asyncio.wait_for(self._last(request), SCORE_TIMEOUT_S)
        except (APIError, ValueError, asyncio.TimeoutError) as exc:
            # e.g. a full queue or a busy engine: this turn goes unscored
            logger.warning("realtime end-of-turn score failed: %r", exc)
            return None
        return end_of_turn_probability(last.logprobs if last is not None else None,
                                       self.token_id)


# -- the decision ---------------------------------------------------------------------------

@dataclass(slots=True)
class PendingTurn:
    """A user turn whose speech paused and whose end is being decided."""
    item_id: str
    speech_end_ms: int       # where the speech ended on the audio timeline
    end_ms: int              # its audio ends here: speech_stopped's audio_end_ms once said
    quiet_since: float       # monotonic time the silence began, as the last audio tells
    next_score_ms: int = 0   # the pause (ms of silence) the next score waits for
    stopped_at: float | None = None    # monotonic time speech_stopped was said; None: not yet


class EndOfTurn:
    """semantic_vad's decision for one session, with no model and no clock of its own: the
    caller gives the score and the times."""

    def __init__(self, eagerness: Eagerness) -> None:
        self.eagerness = eagerness
        self.pending: PendingTurn | None = None

    def stopped(self, item_id: str, end_ms: int, silence_ms: int, now: float) -> PendingTurn:
        """A pause: `silence_ms` of silence heard, up to `end_ms` of audio, at `now`."""
        self.pending = PendingTurn(item_id, end_ms - silence_ms, end_ms,
                                   now - silence_ms / 1000, next_score_ms=silence_ms)
        return self.pending

    def scoring(self, audio_ms: int) -> bool:
        """Whether the pause up to `audio_ms` is due its next score (the one after: twice)."""
        if self.pending is None:
            return False
        pause_ms = audio_ms - self.pending.speech_end_ms
        if pause_ms < self.pending.next_score_ms:
            return False
        self.pending.next_score_ms = 2 * max(pause_ms, 1)
        return True

    def judge(self, score: float | None) -> bool:
        """Whether the pending turn ends now, on its score (it stays pending otherwise)."""
        assert self.pending is not None, "judge without a pending turn"
        if score is not None and score >= self.eagerness.threshold:
            self.pending = None
            return True
        return False

    def resumed(self) -> PendingTurn | None:
        """Speech again: the pending turn (if any) goes on, undecided."""
        pending, self.pending = self.pending, None
        return pending

    def deadline(self) -> float:
        """The monotonic time the pending turn's silence reaches the max wait."""
        assert self.pending is not None
        return self.pending.quiet_since + self.eagerness.max_wait_ms / 1000

    def due(self, audio_ms: int, now: float) -> bool:
        """Whether the pending turn's silence (the audio since its speech ended, or the wall
        clock since it began) has reached the max wait; if so it ends here."""
        if self.pending is None:
            return False
        silence_ms = audio_ms - self.pending.speech_end_ms
        if silence_ms < self.eagerness.max_wait_ms and now < self.deadline():
            return False
        self.pending = None
        return True


# -- the session's side -----------------------------------------------------------------------

class TurnTaking:
    """A session's turn detection after Silero: its events become the protocol's, and a turn
    that ends is committed (and answered, with create_response) on the connection. One lock
    orders the audio's events, the scores' returns and the max-wait timer. `conn`: the
    RealtimeConnection (connection.py imports this module), as vllm_dialect.py takes it."""

    def __init__(self, conn: Any, scorer: TurnScorer | None = None) -> None:
        self.conn = conn
        self.scorer: TurnScorer | None = scorer      # None: ModelScorer.of(client), at first use
        self.decision: EndOfTurn | None = None       # semantic_vad's
        self.timer: asyncio.Task[None] | None = None        # the max wait on the clock
        self.scoring: asyncio.Task[None] | None = None      # the score in flight
        self.finishing: asyncio.Task[None] | None = None    # a timer or score ending a turn
        self.lock = asyncio.Lock()

    def configure(self, vad: ServerVad | SemanticVad | None) -> None:
        """The session's turn_detection (re)set: a pending turn is dropped."""
        self.cancel()
        self.decision = EndOfTurn(EAGERNESS[vad.eagerness]) \
            if isinstance(vad, SemanticVad) else None

    def _stop_waiting(self) -> None:
        """No timer and no score in flight (a score's answer is not wanted any more)."""
        for task in (self.timer, self.scoring):
            if task is not None:
                task.cancel()
        self.timer = self.scoring = None

    def cancel(self) -> None:
        """Forget a pending turn (the buffer cleared or committed by hand, settings changed)."""
        self._stop_waiting()
        if self.decision is not None:
            self.decision.pending = None

    async def close(self) -> None:
        """The session ends: no timer left, and a turn being committed by one is done."""
        self.cancel()
        if self.finishing is not None:
            await asyncio.gather(self.finishing, return_exceptions=True)

    async def hear(self, samples: np.ndarray) -> None:
        """New audio (already in the buffer) through Silero, and what it brings."""
        conn, vad = self.conn, self.conn.vad
        assert vad is not None
        async with self.lock:
            for ev in await run_in_threadpool(vad.feed, samples):
                await self.on_event(ev)
            turn_ms = int(conn.limits.max_turn_s * 1000)
            if vad.speaking and conn.buffer.num_samples > ms_to_samples(turn_ms):
                stop = vad.force_stop()
                if stop is not None:
                    self.cancel()
                    await self.on_event(stop, "max_turn")
            elif self.decision is not None and self.decision.pending is not None:
                await self.listen(self.decision.pending, samples_to_ms(conn.buffer.end))
            elif not vad.speaking:       # hold only the padding a coming turn starts with
                settings = conn.session.audio.input.turn_detection
                assert settings is not None
                padding = ms_to_samples(silero_settings(settings)[2])
                conn.buffer.drop_before(conn.buffer.end - padding)

    async def listen(self, pending: PendingTurn, audio_ms: int) -> None:
        """The pending turn's pause grown to `audio_ms`: max wait, speech_stopped, score."""
        decision, now = self.decision, time.monotonic()
        assert decision is not None
        pending.quiet_since = now - (audio_ms - pending.speech_end_ms) / 1000   # the clock
        if decision.due(audio_ms, now):                  # counts from the last audio on
            self.cancel()
            await self.end_turn(pending, "max_wait")
            return
        if pending.stopped_at is None and audio_ms - pending.speech_end_ms >= SILENCE_MS:
            await self.say_stopped(pending, audio_ms)
        if self.scoring is None and decision.scoring(audio_ms):
            self.score(pending, audio_ms)

    async def on_event(self, ev: VadEvent, forced: str | None = None) -> None:
        conn = self.conn
        settings = conn.session.audio.input.turn_detection
        assert settings is not None
        if ev.kind == "speech_started":
            resumed = self.decision.resumed() if self.decision is not None else None
            self._stop_waiting()
            if resumed is None:          # a new turn: its audio starts here
                conn.speech_item_id = new_id("item")
                conn.buffer.drop_before(ms_to_samples(ev.ms))
            else:                        # the pending turn goes on, its audio kept
                conn.speech_item_id = resumed.item_id
                if resumed.stopped_at is None:
                    return               # the client never heard it stop: nothing to say
            await conn._send(event("input_audio_buffer.speech_started", audio_start_ms=ev.ms,
                                   item_id=conn.speech_item_id))
            if settings.interrupt_response:
                await conn._cancel_response("turn_detected")
            return
        item_id = conn.speech_item_id or new_id("item")
        conn.speech_item_id = None
        now = time.monotonic()
        if self.decision is None or forced is not None:
            pending = PendingTurn(item_id, ev.ms - ev.silence_ms, ev.ms, now)
            await self.end_turn(pending, forced or "silence")
            return
        pending = self.decision.stopped(item_id, ev.ms, ev.silence_ms, now)
        self.timer = asyncio.create_task(self._wait(pending))
        if self.decision.scoring(ev.ms):
            self.score(pending, ev.ms)

    def score(self, pending: PendingTurn, upto_ms: int) -> None:
        """Score the pending turn's audio up to `upto_ms`, in the background."""
        conn = self.conn
        if self.scorer is None:
            self.scorer = ModelScorer.of(conn.client) or SilenceOnly()
        buffer = conn.buffer
        whole = np.concatenate(buffer.chunks) if buffer.chunks else np.zeros(0, np.float32)
        audio = whole[:max(0, ms_to_samples(upto_ms) - buffer.start)]
        messages = conn.conversation.messages(conn.session.instructions)
        self.scoring = asyncio.create_task(self._judge(pending, messages, audio, upto_ms))

    async def _judge(self, pending: PendingTurn, messages: list[dict[str, Any]],
                     audio: np.ndarray, upto_ms: int) -> None:
        """A score's answer: the turn ends now, or waits (for its next score, its max wait,
        or speech again, which cancels this task)."""
        assert self.scorer is not None
        decision = self.decision
        try:
            score = await self.scorer.score(messages, audio)
        except Exception:                # our fault: unscored, its silence decides
            logger.exception("realtime end-of-turn score of %s failed", pending.item_id)
            score = None
        metrics = self.conn.client.metrics
        if score is not None and metrics is not None:
            metrics.end_of_turn_score.observe(score)
        async with self.lock:
            if self.scoring is asyncio.current_task():
                self.scoring = None
            if decision is None or decision.pending is not pending or \
                    self.decision is not decision or not decision.judge(score):
                return
            if pending.stopped_at is None:
                pending.end_ms = upto_ms         # the turn is the audio judged
            self._stop_waiting()
            await self._finish(pending, "score")

    async def _wait(self, pending: PendingTurn) -> None:
        """The max wait by the wall clock (a client that stopped sending audio)."""
        decision = self.decision
        assert decision is not None
        while decision.pending is pending and time.monotonic() < decision.deadline():
            await asyncio.sleep(decision.deadline() - time.monotonic())   # audio moves it
        async with self.lock:
            if decision.pending is not pending or self.decision is not decision:
                return
            decision.pending, self.timer = None, None
            self._stop_waiting()
            await self._finish(pending, "max_wait")

    async def _finish(self, pending: PendingTurn, decided_by: str) -> None:
        """end_turn from a task of its own (a timer, a score), errors said on the socket."""
        self.finishing = asyncio.current_task()
        try:
            await self.end_turn(pending, decided_by)
        except APIError as err:          # e.g. the queue is full: said, the session goes on
            await self.conn._send(error_event(err))
        except Exception:                # our fault: said so, and the session goes on
            logger.exception("realtime turn %s failed to end", pending.item_id)
            await self.conn._send(error_event(APIError(
                500, "the server failed to end the turn", code="internal_error")))
        finally:
            self.finishing = None

    async def say_stopped(self, pending: PendingTurn, end_ms: int) -> None:
        """speech_stopped for the pending turn, its audio ending at `end_ms`."""
        pending.end_ms, pending.stopped_at = end_ms, time.monotonic()
        await self.conn._send(event("input_audio_buffer.speech_stopped", audio_end_ms=end_ms,
                                    item_id=pending.item_id))

    async def end_turn(self, pending: PendingTurn, decided_by: str) -> None:
        """The turn's audio (up to its speech_stopped) committed, timed, and answered."""
        conn = self.conn
        if pending.stopped_at is None:
            await self.say_stopped(pending, pending.end_ms)
        assert pending.stopped_at is not None
        await conn._commit(ms_to_samples(pending.end_ms), pending.item_id)
        if conn.client.metrics is not None:
            conn.client.metrics.turn_taking.labels(decided_by).observe(
                time.monotonic() - pending.stopped_at)
        settings = conn.session.audio.input.turn_detection
        if settings is not None and settings.create_response:
            await conn._response_create({})
