"""The generation stage engine: non-autoregressive decoders (code2wav, vocoders, toy models),
batched over whatever input chunks are ready.

A request collects input chunks (dicts of tensors). Each step takes the requests with pending
input (FIFO, at most max_num_seqs), hands their new input to the model in one call, and emits
one output chunk per request that produced one. A request finishes once its input is closed
and consumed, and the model holds no backlog for it.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from omnistage.errors import StageError
from omnistage.utils import trace

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    arrival_time: float
    pending: list[dict[str, Tensor]] = field(default_factory=list)
    input_closed: bool = False
    state: dict = field(default_factory=dict)     # the model's per-request memory (left context)
    num_chunks_out: int = 0
    first_scheduled_time: float | None = None
    first_output_time: float | None = None
    model_seconds: float = 0.0          # time in the model calls this request was part of

    def take_input(self) -> dict[str, Tensor]:
        """All pending chunks, concatenated along dim 0 per key."""
        chunks, self.pending = self.pending, []
        keys = chunks[0].keys()
        return {k: torch.cat([c[k] for c in chunks]) for k in keys}


class GenerationModel(Protocol):
    """One call over a batch: for each request, its new input, its state and whether its input
    is closed; returns one output dict per request (may be empty). A model may leave ready
    work for a later call (a budget per forward): `has_backlog(state)` says so, and the
    request is stepped again without new input and finishes only once it has none.

    A call that raises is made again for each request alone (to find the one that broke it),
    from a snapshot of the states taken before it: a copy of each state's values, one level
    deep. So `generate` changes what is deeper (a tensor, an attribute of a stream object)
    by replacing it, never in place."""

    def generate(self, inputs: list[dict[str, Tensor]], states: list[dict],
                 is_last: list[bool]) -> list[dict[str, Tensor]]: ...

    def has_backlog(self, state: dict) -> bool: ...

    # facts for the front door, sent at the stage's handshake (a vocoder's sample rate)
    info: dict[str, str | int | float]
    # the record of its stage's `generation.options` (configs/options.py), handed to its
    # `from_pretrained(path, component, device, dtype, options)`
    Options: ClassVar[type]


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    tensors: dict[str, Tensor]         # the model's output (packed payload records)
    finished: bool
    error: StageError | None = None
    request: GenerationRequest | None = None


class GenerationEngine:
    def __init__(self, model: GenerationModel, max_num_seqs: int = 64) -> None:
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.requests: OrderedDict[str, GenerationRequest] = OrderedDict()

    def add_request(self, request_id: str, arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        self.requests[request_id] = GenerationRequest(request_id, arrival_time or time.time())

    def feed(self, request_id: str, tensors: dict[str, Tensor] | None, close: bool) -> None:
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not running")
        if req.input_closed:
            raise ValueError(f"request {request_id!r}: its input is already closed")
        if tensors:
            if req.pending and req.pending[0].keys() != tensors.keys():
                raise ValueError(f"request {request_id!r}: chunk keys {sorted(tensors)} differ "
                                 f"from earlier {sorted(req.pending[0])}")
            req.pending.append(tensors)
        req.input_closed = req.input_closed or close

    def abort(self, request_id: str) -> GenerationRequest | None:
        return self.requests.pop(request_id, None)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[GenerationResult]:
        """Run the model once over the requests with new input, closed input or backlog (FIFO,
        at most max_num_seqs); results for those that produced output or finished."""
        ready = [r for r in self.requests.values()
                 if r.pending or r.input_closed or self.model.has_backlog(r.state)]
        ready = ready[:self.max_num_seqs]
        if not ready:
            return []
        now = time.time()
        for r in ready:
            r.first_scheduled_time = r.first_scheduled_time or now
        inputs = [r.take_input() if r.pending else {} for r in ready]
        is_last = [r.input_closed for r in ready]
        outs = self._generate_isolating(ready, inputs, is_last)
        done = time.time()
        if trace.enabled():
            trace.span("generate", now, done, requests=[r.request_id for r in ready],
                       outputs=[r.request_id for r, out in zip(ready, outs) if out])
        results = []
        for r, out, closed in zip(ready, outs, is_last):
            r.model_seconds += done - now
            if isinstance(out, str):        # it failed alone: the others go on
                del self.requests[r.request_id]
                results.append(GenerationResult(r.request_id, {}, True,
                                                StageError.internal(out), r))
                continue
            if out:
                r.num_chunks_out += 1
                r.first_output_time = r.first_output_time or done
            finished = closed and not self.model.has_backlog(r.state)
            if finished:
                del self.requests[r.request_id]
            if out or finished:
                results.append(GenerationResult(r.request_id, out, finished, None, r))
        return results

    def _generate_isolating(self, ready: list[GenerationRequest],
                            inputs: list[dict[str, Tensor]], is_last: list[bool]
                            ) -> list[dict[str, Tensor] | str]:
        """One model call over `ready` -> each request's output, or its error. A call that
        raises is made again per request, from the states as they were before it (a snapshot
        one level deep: see GenerationModel), so one request whose input breaks the model
        fails alone; an output that holds inf or NaN fails its request alone."""
        before = [_snapshot(r.state) for r in ready]
        try:
            with torch.inference_mode():
                outs: list[dict[str, Tensor] | str] = list(
                    self.model.generate(inputs, [r.state for r in ready], is_last))
        except Exception as exc:
            logger.exception("generation step failed for %d requests", len(ready))
            if len(ready) == 1:
                return [f"{type(exc).__name__}: {exc}"]
            outs = []
            for r, x, state, last in zip(ready, inputs, before, is_last):
                r.state.clear()
                r.state.update(state)
                try:
                    with torch.inference_mode():
                        outs.append(self.model.generate([x], [r.state], [last])[0])
                except Exception as alone:
                    outs.append(f"{type(alone).__name__}: {alone}")
        return [_finite_or_error(out) for out in outs]


def _snapshot(state: dict) -> dict:
    """A request's model state as it is now, one level deep (GenerationModel's contract)."""
    return {k: copy.copy(v) for k, v in state.items()}


def _finite_or_error(out: dict[str, Tensor] | str) -> dict[str, Tensor] | str:
    if isinstance(out, str):
        return out
    for name, t in out.items():
        if t.is_floating_point() and not bool(t.isfinite().all()):
            return (f"the model's output {name!r} holds inf or NaN: the request's input "
                    "overflows the model")
    return out
