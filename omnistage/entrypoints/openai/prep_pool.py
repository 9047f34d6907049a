"""The preparation pool: where a request's CPU-heavy work runs before the engine sees it
(media fetched and decoded, the chat template rendered, the prompt tokenized, the input
processor's features extracted), off the event loop, so that /health and every other route
answer while it runs.

    route: cheap checks -> client.start: admit (429) -> pool.run(prepare) -> submit
                                                         │ 429 while max_pending are queued
                                                         └ or running; on one of `workers`

Threads suffice because the heavy parts release the GIL: PIL and PyAV decoding, numpy, the
Rust tokenizer while it tokenizes (transformers calls its `encode_batch`). What holds the GIL
is building, and freeing, the Python side of a tokenization, in proportion to its token
count (about 0.2 s per million tokens). So a text longer than LONG_TEXT_CHARS is counted
first in a child process (`TokenCounter`): the API process tokenizes only texts that fit the
model (fewer than max_model_len tokens), and a 10 MB prompt is refused without stalling it.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import pickle
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any, Callable, TypeVar

from omnistage.entrypoints.openai.errors import APIError, bad_request
from omnistage.entrypoints.openai.prompt_size import (chars_per_token, check_prompt_chars,
                                                      max_prompt_chars)

T = TypeVar("T")
logger = logging.getLogger(__name__)
RETRY_AFTER_S = 1
# longer texts are counted in the child process before the API process tokenizes them
# (200 k characters: at most about 40 ms of GIL held for a tokenization here)
LONG_TEXT_CHARS = 200_000


class PrepPool:
    """A bounded thread pool: `workers` threads, at most `max_pending` jobs queued or running
    (a job counts until its thread is done with it, even when its client went away)."""

    def __init__(self, workers: int, max_pending: int) -> None:
        if workers < 1 or max_pending < workers:
            raise ValueError(f"prep_workers={workers}, max_pending_prep={max_pending}: need "
                             "workers >= 1 and max_pending >= workers")
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="prep")
        self.max_pending = max_pending
        self.num_pending = 0
        self._lock = threading.Lock()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a pool thread; 429 when the pool's queue is full."""
        with self._lock:
            if self.num_pending >= self.max_pending:
                raise APIError(429, f"the server is preparing {self.max_pending} requests, "
                                    f"its limit; retry in {RETRY_AFTER_S} s",
                               code="prep_queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            self.num_pending += 1
        # in a copy of the caller's context: what `fn` records per request (the fields it
        # ignored, engine/request.py `ignore`) reaches the caller's answer
        future = self.executor.submit(contextvars.copy_context().run,
                                      functools.partial(fn, *args))
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def _done(self, _: Future) -> None:
        with self._lock:
            self.num_pending -= 1

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class TokenCounter:
    """Token counts of long texts, taken by one child process (token_count.py: started on first
    use with a copy of the tokenizer, restarted if it dies), so that the GIL-bound part of
    tokenizing them never runs here. A plain subprocess, not multiprocessing: nothing of the
    parent (its threads, its main module) is forked or imported again."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._chars_per_token: int | None = None        # prompt_size.chars_per_token, once
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def check(self, text: str, max_tokens: int | None, param: str) -> None:
        """400 naming `param` when `text` has max_tokens tokens or more (blocking: call it from
        the preparation pool). Short texts pass unchecked: tokenizing them here is cheap, and
        so is a text the child cannot tokenize (the engine's own tokenization refuses it). A
        text too long to fit is refused by its length, untokenized (prompt_size.py)."""
        if len(text) <= LONG_TEXT_CHARS:
            return
        if self._chars_per_token is None:
            self._chars_per_token = chars_per_token(self.tokenizer)
        check_prompt_chars(len(text), max_prompt_chars(max_tokens, self._chars_per_token,
                                                       LONG_TEXT_CHARS), max_tokens, param)
        if max_tokens is None or self.tokenizer is None:
            return
        num_tokens = self.count(text)
        if num_tokens >= max_tokens:
            raise bad_request(f"{param}: the prompt has {num_tokens} tokens or more, but the "
                              f"model's maximum length is {max_tokens}", param,
                              "prompt_too_long")

    def count(self, text: str) -> int:
        """The text's token count (no special tokens), or -1 when it does not tokenize."""
        with self._lock:                  # one text at a time through the pipe
            try:
                proc = self._child()
                write_frame(proc.stdin, text.encode("utf-8", "surrogatepass"))
                return int.from_bytes(read_frame(proc.stdout), "little", signed=True)
            except (OSError, EOFError) as exc:
                self._stop()
                logger.warning("the token counter died: %s", exc)
                raise APIError(503, "the token counter died; retry",
                               code="tokenizer_unavailable") from None

    def _child(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                   "TOKENIZERS_PARALLELISM": "false"}
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "omnistage.entrypoints.openai.token_count"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            write_frame(self._proc.stdin, pickle.dumps(self.tokenizer))
        return self._proc

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


def write_frame(pipe: IO[bytes], data: bytes) -> None:
    pipe.write(len(data).to_bytes(8, "little") + data)
    pipe.flush()


def read_frame(pipe: IO[bytes]) -> bytes:
    size = int.from_bytes(_read_exactly(pipe, 8), "little")
    return _read_exactly(pipe, size)


def _read_exactly(pipe: IO[bytes], size: int) -> bytes:
    data = pipe.read(size)
    if data is None or len(data) != size:
        raise EOFError("the pipe closed")
    return data
