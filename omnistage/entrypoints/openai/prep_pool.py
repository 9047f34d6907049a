"""The preparation pool: where a request's CPU-heavy work runs before the engine sees it
(media fetched and decoded, the chat template rendered, the prompt tokenized, the input
processor's features extracted), off the event loop, so that /health and every other route
answer while it runs.

    route: cheap checks -> client.admit (429) -> pool.run(prepare) -> client.submit
                                                  │ 429 while max_pending are queued or running
                                                  └ on one of `workers` threads

Threads suffice because the heavy parts release the GIL: PIL and PyAV decoding, numpy, the
Rust tokenizer while it tokenizes (transformers calls its `encode_batch`). What holds the GIL
is building, and freeing, the Python side of a tokenization, in proportion to its token
count (about 0.2 s per million tokens). So a text longer than LONG_TEXT_CHARS is counted
first in a child process (`TokenCounter`): the API process tokenizes only texts that fit the
model (fewer than max_model_len tokens), and a 10 MB prompt is refused without stalling it.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import pickle
import threading
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from omnistage.entrypoints.openai.errors import APIError, bad_request

T = TypeVar("T")
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
        future = self.executor.submit(functools.partial(fn, *args))
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def _done(self, _: Future) -> None:
        with self._lock:
            self.num_pending -= 1

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class TokenCounter:
    """Token counts of long texts, taken in one child process (started on first use, with a
    copy of the tokenizer), so the GIL-bound part of tokenizing them never runs here."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def check(self, text: str, max_tokens: int | None, param: str) -> None:
        """400 naming `param` when `text` has max_tokens tokens or more (blocking: call it from
        the preparation pool). Short texts pass unchecked: tokenizing them here is cheap."""
        if max_tokens is None or self.tokenizer is None or len(text) <= LONG_TEXT_CHARS:
            return
        num_tokens = self._child().submit(_count, text).result()
        if num_tokens >= max_tokens:
            raise bad_request(f"{param}: the prompt has {num_tokens} tokens or more, but the "
                              f"model's maximum length is {max_tokens}", param,
                              "prompt_too_long")

    def _child(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    1, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_load_tokenizer, initargs=(pickle.dumps(self.tokenizer),))
            return self._pool

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None


_TOKENIZER: Any = None     # the child process's copy


def _load_tokenizer(data: bytes) -> None:
    global _TOKENIZER
    _TOKENIZER = pickle.loads(data)


def _count(text: str) -> int:
    return len(_TOKENIZER(text, add_special_tokens=False)["input_ids"])
