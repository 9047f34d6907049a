"""The server's one door to the engine: every route's requests go through `start` (or
`generate`, which is `start`, the outputs and the close): admission, preparation, submission,
the stream of outputs, the abort when the caller goes away, and the engine's errors as HTTP.

    route:  cheap checks (no media fetched), OpenAI fields -> client.request(...)  -> 400
            client.start(requests or a function making them, slots)
                  admission                    more than max_queue in flight   -> 429 + Retry-After
                  preparation, on the pool     the preparation pool full       -> 429 + Retry-After
                     (media, template, tokens, engine.prepare: ValueError     -> 400)
                  submission                   engine dead                     -> 503
            -> async for out in handle.outputs(): ...  (a failed one: client.failure -> 4xx/5xx)
            -> handle.close()   (always) abort if unfinished, release its slots

Submission is synchronous, so every error that can be told before the first byte of the
answer is told with its own status. A `RequestHandle` is closed exactly once, by whoever ends
the request: the route, the streaming response (even one never started), or the disconnect
watch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import threading
import uuid
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from omnistage.engine.inputs import ParsedPrompt, PromptType
from omnistage.engine.request import OmniRequest, RequestFields, build_request, ignore
from omnistage.entrypoints.openai.errors import APIError, bad_request, from_value_error
from omnistage.entrypoints.openai.log_lines import log_request
from omnistage.entrypoints.openai.prep_pool import PrepPool, TokenCounter
from omnistage.errors import InputError
from omnistage.outputs import OmniOutput
from omnistage.sampling_params import SamplingParams

if TYPE_CHECKING:
    from starlette.requests import Request

    from omnistage.engine.async_omni import AsyncOmni
    from omnistage.engine.request import StageParams
    from omnistage.outputs import RequestEvent
    from omnistage.entrypoints.openai.metrics import ServerMetrics
    from omnistage.stages.messages import StageStats

Prepared = tuple[ParsedPrompt, dict[str, "StageParams"]]
# what a route's request maker returns per request: a record, or one it prepared itself
Ready = tuple[OmniRequest, Prepared]
Make = Callable[[], Sequence["OmniRequest | Ready"]]
AsyncMake = Callable[[], Awaitable[Sequence["OmniRequest | Ready"]]]
# how a stage's refusal reads: "stage 'dit': ValueError: prompt names no digit ..."
RETRY_AFTER_S = 1
DEFAULT_PREP_WORKERS = 4
DEFAULT_MAX_PENDING_PREP = 64
T = TypeVar("T")
logger = logging.getLogger(__name__)


class Ticket:
    """One admitted request's slots in the bounded queue; released once."""

    def __init__(self, client: EngineClient, n: int) -> None:
        self.client, self.n, self.released = client, n, False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.client.num_in_flight -= self.n

    def split(self, sizes: list[int]) -> list[Ticket]:
        """The slots handed on as one ticket per request (sizes summing to this one's)."""
        assert sum(sizes) == self.n and not self.released, (sizes, self.n, self.released)
        self.released = True
        return [Ticket(self.client, n) for n in sizes]


class RequestHandle:
    """One submitted request: its events arrive from the router thread into an asyncio queue."""

    def __init__(self, client: EngineClient, request_id: str, ticket: Ticket | None = None,
                 param: str | None = None) -> None:
        self.client = client
        self.request_id = request_id
        self.ticket = ticket          # its slots in the queue, released by `close`
        self.param = param            # the request field a failure names by default
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self.out: OmniOutput | None = None
        self.closed = False
        self.seen_audio = False
        self._first: OmniOutput | None = None

    def sink(self, ev: RequestEvent) -> None:  # router thread (or this one, on abort)
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    async def _next(self) -> OmniOutput:
        assert self.out is not None, "outputs before submit"
        snap = self.out.apply(await self.queue.get())
        metrics = self.client.metrics
        if metrics is not None:
            if not self.seen_audio and snap.delta_audio is not None:
                self.seen_audio = True
                metrics.observe_first_audio(self.out)
            if snap.finished:
                metrics.observe_finished(snap)
                log_request(snap, metrics.model_name)
        if snap.finished:           # what a stage accepted and did not use: the answer says so
            for stage, m in snap.stage_metrics.items():
                for name in m.ignored:
                    ignore(name, f"stage {stage!r} does not use it for this request")
        return snap

    async def first(self) -> OmniOutput:
        """Wait for the first update (kept for `outputs`): a stream starts only once the
        engine has taken the request, so an input the stages reject still gets its 400."""
        if self._first is None:
            self._first = await self._next()
        return self._first

    async def outputs(self) -> AsyncIterator[OmniOutput]:
        """Snapshots with the deltas of each update; the last one has finished=True."""
        snap = await self.first()
        yield snap
        while not snap.finished:
            snap = await self._next()
            yield snap

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.ticket is not None:
            self.ticket.release()
        if self.out is not None and not self.out.finished:
            self.client.engine.abort(self.request_id)
            if self.client.metrics is not None:
                self.client.metrics.finished.labels("abort").inc()
                log_request(self.out, self.client.metrics.model_name, status="abort")


class EngineClient:
    def __init__(self, engine: AsyncOmni, max_queue: int,
                 metrics: ServerMetrics | None = None, prep: PrepPool | None = None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue={max_queue}: must be >= 1")
        self.engine = engine
        self.prep = prep or PrepPool(DEFAULT_PREP_WORKERS, DEFAULT_MAX_PENDING_PREP)
        self.max_queue = max_queue
        self.metrics = metrics
        self.num_in_flight = 0
        self.graph = engine.graph
        self.tokenizer = engine.tokenizer
        self.processor = getattr(engine, "processor", None)   # multimodal input processor
        self.outputs: set[str] = {s.final for s in engine.graph.stages if s.final}
        self.entry: list[str] = list(engine.entry)
        self.text_entry: bool = engine.text_entry
        self.counter = TokenCounter(self.tokenizer)
        self._stats_lock = threading.Lock()

    # -- facts -----------------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self.engine.is_healthy

    @property
    def dead_reason(self) -> str | None:
        return getattr(self.engine.orchestrator, "dead_reason", None)

    @property
    def degraded_reason(self) -> str | None:
        """Why the engine serves short-handed (a replica down, every stage still served)."""
        return self.engine.orchestrator.degraded_reason

    def replica_status(self) -> dict[str, list[dict[str, int | bool]]]:
        return self.engine.orchestrator.replica_status()

    @property
    def max_model_len(self) -> int | None:
        info = self.engine.orchestrator.stage_info
        lens = [info[n].max_model_len for n in self.entry if n in info]
        return min((n for n in lens if n is not None), default=None)

    @property
    def foreign_backend(self) -> dict[str, str]:
        """{"backend", "pipeline"} of the first stage that runs its model outside omnistage's
        own code (the generic diffusers adapter says so in its stage info); {} if none."""
        for info in self.engine.orchestrator.stage_info.values():
            if info.backend is not None:
                return {"backend": info.backend, "pipeline": str(info.pipeline)}
        return {}

    def stage_stats(self, timeout_s: float = 2.0) -> dict[str, StageStats]:
        """Each stage's resource state (blocking: call from a worker thread)."""
        with self._stats_lock:  # the orchestrator gathers one round of answers at a time
            return dict(self.engine.orchestrator.stage_stats(timeout_s))

    # -- a request's life ------------------------------------------------------------------------
    def check_healthy(self) -> None:
        if not self.is_healthy:
            raise APIError(503, f"the engine is not serving: {self.dead_reason}",
                           code="engine_dead")

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the preparation pool (prep_pool.py): 429 when it is full."""
        return await self.prep.run(fn, *args)

    def request(self, prompt: PromptType, fields: RequestFields, modalities: set[str] | None,
                prefix: str, **kw: object) -> OmniRequest:
        """The request record (engine/request.py `build_request`); a bad field is a 400."""
        try:
            return build_request(self.graph, self.entry, prompt, fields, modalities=modalities,
                                 prefix=prefix, **kw)
        except ValueError as exc:
            raise from_value_error(exc) from None

    def prepare(self, request: OmniRequest) -> Prepared:
        """The engine's own input checks; a ValueError is the client's (400, naming
        `request.param` when the message does not name a field itself). Blocking (it
        tokenizes; an input processor extracts features): `start` runs it on the pool. A long
        text is counted first, in a child process (prep_pool.TokenCounter). `max_tokens`:
        (its field, the value the request gave): the prompt and that many new tokens must fit
        the context, as vLLM checks (400; the engine alone would stop the answer at the
        context's end)."""
        param = request.param
        text = prompt_text(request.prompt)
        if text is not None:
            self.counter.check(text, self.max_model_len, param or "prompt")
        try:
            prepared = self.engine.prepare(request)
        except ValueError as exc:
            raise from_value_error(exc, param) from None
        limit, n = self.max_model_len, prepared[0].num_tokens
        if request.max_tokens is not None and limit is not None \
                and n + request.max_tokens[1] > limit:
            field, wanted = request.max_tokens
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {n + wanted} tokens ({n} in the {param or 'prompt'}, {wanted} in "
                f"the completion). Please reduce the length of the {param or 'prompt'} or "
                "completion.", field)
        return prepared

    def close(self) -> None:
        """The preparation pool and the token counter's child process (server shutdown)."""
        self.prep.shutdown()
        self.counter.close()

    def admit(self, n: int = 1) -> Ticket:
        self.check_healthy()
        if self.num_in_flight + n > self.max_queue:
            raise APIError(429, f"the server is at its limit of {self.max_queue} requests in "
                                f"flight; retry in {RETRY_AFTER_S} s", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.num_in_flight += n
        return Ticket(self, n)

    async def start(self, requests: Sequence[OmniRequest] | Make | AsyncMake,
                    slots: int | None = None) -> list[RequestHandle]:
        """The front door: admission (`slots`: every completion of every request; a function
        making the requests needs it said), preparation on the pool (a plain function too:
        its prompt may load media; an async one is awaited first), submission. All or none:
        each handle holds its requests' slots, released by its `close`."""
        if slots is None:
            assert not callable(requests), "start(make, slots): say how many slots it takes"
            slots = sum(num_completions(r) for r in requests)
        ticket = self.admit(slots)
        handles: list[RequestHandle] = []
        try:
            if inspect.iscoroutinefunction(requests):
                requests = await requests()
            ready = await self.run(self._prepare_all, requests)
            sizes = [num_completions(r) for r, _ in ready]
            if sum(sizes) != ticket.n:   # `n` set in sampling_params_list, beside the field
                self._resize(ticket, sum(sizes))
            for (request, prepared), share in zip(ready, ticket.split(sizes)):
                handles.append(self._submit(request, prepared, share))
        except BaseException:
            for h in handles:
                h.close()
            ticket.release()
            raise
        return handles

    async def generate(self, requests: Sequence[OmniRequest] | Make | AsyncMake,
                       slots: int | None = None) -> AsyncIterator[OmniOutput]:
        """One request's outputs through `start`; a failed request raises its APIError; the
        request is closed however the iteration ends."""
        [handle] = await self.start(requests, slots)
        try:
            async for out in handle.outputs():
                if failed(out):
                    raise self.failure(out, handle.param)
                yield out
        finally:
            handle.close()

    def _resize(self, ticket: Ticket, n: int) -> None:
        """A ticket's slots made `n`: more only if the queue has room (else 429)."""
        more = n - ticket.n
        if more > 0:
            self.admit(more).released = True       # counted, now held by `ticket`
        else:
            self.num_in_flight += more
        ticket.n = n

    def _prepare_all(self, requests: Sequence[OmniRequest] | Make) -> list[Ready]:
        made = requests() if callable(requests) else requests
        return [(r, self.prepare(r)) if isinstance(r, OmniRequest) else r for r in made]

    def _submit(self, request: OmniRequest, prepared: Prepared, ticket: Ticket
                ) -> RequestHandle:
        handle = RequestHandle(self, f"{request.prefix}-{uuid.uuid4().hex[:16]}", ticket,
                               request.param)
        request = dataclasses.replace(request, request_id=handle.request_id)
        try:
            handle.out = self.engine.add_request(request, handle.sink, prepared)
        except BaseException as exc:
            ticket.release()
            if isinstance(exc, ValueError):
                raise from_value_error(exc) from None
            if isinstance(exc, RuntimeError):  # the orchestrator refuses: a stage is dead
                raise APIError(503, str(exc), code="engine_dead") from None
            raise
        return handle

    def check(self, out: OmniOutput, param: str | None = None) -> None:
        """Raise the APIError for a finished output that failed or was cut short."""
        if failed(out):
            raise self.failure(out, param)

    async def open_stream(self, request: Request, handles: list[RequestHandle],
                          closers: list[Callable[[], None]], param: str | None) -> None:
        """Before a 200 and its event stream go out: wait for each request's first update,
        so that a request the stages reject on arrival still gets its own status."""
        try:
            for handle in handles:
                self.check(await unless_disconnected(request, handle.first), param)
        except BaseException:
            for close in closers:
                close()
            raise

    def failure(self, out: OmniOutput, param: str | None = None) -> APIError:
        """The error for a request the engine failed (finish_reason "error") or dropped
        (shut down); `param` names the request field when a stage rejected the input without
        naming one."""
        error = out.error or "unknown error"
        if out.finish_reason == "abort":
            return APIError(503, f"the request was aborted: {out.error or 'engine shut down'}",
                            code="engine_shutdown")
        info = out.error
        if info is not None and info.kind == "invalid_input":   # a stage refused the input
            err = from_value_error(InputError(info.message, info.param), None)
            err.param, err.code = err.param or param, "invalid_input"
            return err
        if not self.is_healthy:
            return APIError(503, f"the engine is not serving: {self.dead_reason}",
                            code="engine_dead")      # (how the stage ended, not its text)
        if info is not None and info.kind == "stage_dead":
            # its stage died, and a restart has made the engine healthy again: still 503
            return APIError(503, f"the engine was not serving: stage {info.stage!r} died",
                            code="engine_dead")
        if info is not None and info.kind == "timeout":       # a stage's input stalled
            return APIError(504, f"the request timed out in the engine: {error}",
                            code="engine_timeout")
        # a stage's own exception may name files, processes or internals: the log has it
        logger.error("a request failed in the engine: %s", error)
        where = f" (stage {info.stage!r})" if info is not None and info.stage else ""
        return APIError(500, f"the request failed in the engine{where}; the server's log has "
                             "the details", code="engine_error")


def prompt_text(prompt: PromptType) -> str | None:
    """The text the engine would tokenize: a string prompt, a dict's `prompt`, or the text of
    chat messages (their string contents and text parts)."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, dict):
        return None
    if isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    texts = []
    for message in prompt.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [p["text"] for p in content if isinstance(p, dict) and
                      isinstance(p.get("text"), str)]
    return "\n".join(texts) if texts else None


def num_completions(request: OmniRequest | Ready) -> int:
    """The slots a request takes in the queue: its entry stages' `n` (each completion runs the
    whole graph)."""
    request = request if isinstance(request, OmniRequest) else request[0]
    return max((p.n for p in request.params if isinstance(p, SamplingParams)), default=1)


def failed(out: OmniOutput) -> bool:
    return out.finished and (out.finish_reason in ("error", "abort") or out.error is not None)


async def until_disconnected(request: Request) -> None:
    """Return once the client has gone (the body was read already, so only the disconnect
    message can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work()`; if the client disconnects first, cancel it (its handles close, which
    aborts their requests in every stage) and raise a 499 nobody will read."""
    task = asyncio.ensure_future(work())
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let its cleanup run
    if task.cancelled():
        logger.info("client disconnected: request cancelled")
        raise APIError(499, "the client closed the request", code="client_closed")
    return task.result()
