"""The generic diffusers adapter's engine: the diffusion stage's engine interface (the one
DiffusionEngine offers it) over whole diffusers calls.

diffusers cannot step one request at a time, so a batch is one call: the oldest request's
`batch_key` picks it, with every waiting request of that key (up to max_num_seqs); a request
arriving meanwhile waits for the next call. The call runs on a thread of its own, so the
stage's loop goes on taking messages and sends each request's progress while it runs:

    add() -> waiting --step(): start a call--> in the call --thread--> images
    step(): progress of each request in the call (diffusers' per-step callback) ...
            ... then, the thread done, each request's images (or the call's error)

An abort drops the request: the call goes on for the others in it, and stops at its next step
when none is left. Step-level batching, step caching, split text encoders and several ranks
need the phases of a native pipeline (pipeline.py) and do not apply here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from omnistage.diffusion.diffusers_pipeline import DiffusersPipeline
from omnistage.diffusion.engine import DiffusionResult
from omnistage.diffusion.params import DiffusionParams
from omnistage.outputs import StageMetrics
from omnistage.errors import StageError

logger = logging.getLogger(__name__)


class CallCancelled(Exception):
    """Raised in a call's step callback once every request of the call was aborted."""


@dataclass(slots=True)
class WholeRequest:
    request_id: str
    prompt: str
    params: DiffusionParams
    seed: int
    arrival_time: float
    first_step_time: float | None = None


@dataclass(slots=True)
class Call:
    """One diffusers call in flight: its requests, and what its thread reports back (the
    steps done through `steps`, then images or error once `thread` has ended)."""

    batch: list[WholeRequest]
    steps: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)   # (done, total)
    thread: threading.Thread | None = None
    images: list[Tensor] | None = None
    error: BaseException | None = None
    cancelled: bool = False          # set by the engine's thread, read by the call's


class DiffusersEngine:
    def __init__(self, pipeline: DiffusersPipeline, max_num_seqs: int = 16) -> None:
        self.pipeline = pipeline
        self.max_num_seqs = max_num_seqs
        self.requests: OrderedDict[str, WholeRequest] = OrderedDict()   # waiting or in a call
        self.call: Call | None = None
        self.num_calls = 0

    def add_request(self, request_id: str, prompt: str | None, params: DiffusionParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        params.validate()
        self.pipeline.validate(prompt, params)
        assert prompt is not None       # validate refuses conditioning from upstream
        seed = params.seed if params.seed is not None else int(torch.seed() % 2**63)
        self.requests[request_id] = WholeRequest(request_id, prompt, params, seed,
                                                 arrival_time or time.time())

    def abort(self, request_id: str) -> WholeRequest | None:
        req = self.requests.pop(request_id, None)
        call = self.call
        if call is not None and not self._live(call):
            call.cancelled = True
        return req

    def is_parked(self, request_id: str) -> bool:
        return False                    # nothing waits for conditioning from upstream

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        """Requests in the call now (the others wait for a later call)."""
        call = self.call
        return 0 if call is None else len(self._live(call))

    def step(self) -> list[DiffusionResult]:
        """Start a call if none runs; -> the progress its requests made since the last step,
        and their results once it has ended."""
        if self.call is None:
            self._start()
        call = self.call
        if call is None:
            return []
        results = self._progress(call)
        assert call.thread is not None
        if not call.thread.is_alive():
            call.thread.join()
            self.call = None
            results += self._finish(call)
        return results

    def _live(self, call: Call) -> list[WholeRequest]:
        """The call's requests not aborted since (an id added again is another request)."""
        return [r for r in call.batch if self.requests.get(r.request_id) is r]

    def _start(self) -> None:
        if not self.requests:
            return
        key = self.pipeline.batch_key(next(iter(self.requests.values())).params)
        batch = [r for r in self.requests.values()
                 if self.pipeline.batch_key(r.params) == key][:self.max_num_seqs]
        now = time.time()
        for r in batch:
            r.first_step_time = now
        call = Call(batch)
        call.thread = threading.Thread(target=self._run, args=(call,), daemon=True,
                                       name="diffusers-call")
        self.call = call
        self.num_calls += 1
        call.thread.start()

    def _run(self, call: Call) -> None:
        """The call's thread: the pipeline over the batch; images or the error on `call`."""
        def on_step(done: int, total: int) -> None:
            if call.cancelled:
                raise CallCancelled
            call.steps.put((done, total))

        dev = self.pipeline.device
        try:
            with torch.inference_mode(), (torch.cuda.device(dev) if dev.type == "cuda"
                                          else nullcontext()):
                call.images = self.pipeline.run([r.prompt for r in call.batch],
                                                [r.params for r in call.batch],
                                                [r.seed for r in call.batch], on_step)
        except CallCancelled:
            pass
        except Exception as exc:   # a failing call fails its requests, not the engine
            logger.exception("diffusers call failed for %d requests", len(call.batch))
            call.error = exc

    def _progress(self, call: Call) -> list[DiffusionResult]:
        """A progress signal per live request of the call for each step reported since the
        last engine step (as the native engine sends one per step)."""
        results = []
        while not call.steps.empty():
            done, total = call.steps.get()
            progress = min(done / total, 1.0)
            results += [DiffusionResult(r.request_id, None, False, progress)
                        for r in self._live(call)]
        return results

    def _finish(self, call: Call) -> list[DiffusionResult]:
        """Each live request's images, or the call's error."""
        live = [(i, r) for i, r in enumerate(call.batch) if self.requests.get(r.request_id) is r]
        for _, r in live:
            del self.requests[r.request_id]
        if call.error is not None or call.images is None:
            error = (f"{type(call.error).__name__}: {call.error}" if call.error is not None
                     else "the diffusers call returned no images")
            return [DiffusionResult(r.request_id, None, True, 1.0, StageError.internal(error))
                    for _, r in live]
        done = time.time()
        return [DiffusionResult(
            r.request_id, call.images[i], True, 1.0, metrics=StageMetrics(
                queue_time=r.first_step_time - r.arrival_time,
                num_steps=r.params.num_inference_steps, denoise_time=done - r.first_step_time))
            for i, r in live]
