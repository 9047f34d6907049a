"""A fake stage engine for the contract test of the stage interface (stages/interface.py):
no model, a few tokens per step, behaviour chosen by the request's first prompt token, and a
record of every call it got, readable from the test (backend inproc: same process).

    first prompt token   what the stage does with the request
    OK (1)               `progress` k/n each step, then its STEPS tokens at once, finished
    BAD_INPUT (2)        refuses it in add(): InputError(param="prompt") -> invalid_input
    CRASH (3)            its step raises RuntimeError                    -> internal
    DIE (4)              its step raises SystemExit: the stage's thread ends -> stage_dead
    SLOW (5)             one token per step, never finishes on its own (for abort)

A downstream copy (fed along an edge by the `testing_contract.tokens` adapter) emits each
token it is fed plus 100, and finishes once its input is closed.

Importing this module registers the "testing_contract" family (AR component `fake_stage`,
adapter `testing_contract.tokens`); the production table knows nothing of it.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

from omnistage.configs.schema import StageConfig
from omnistage.errors import InputError
from omnistage.payloads import Payload, TokenDelta
from omnistage.registry import Component, ModelFamily, register_family
from omnistage.stages.adapters import EdgeData, StageFeed, register_adapter
from omnistage.stages.interface import EngineStats, StageInfo, StageRequest, StageResult

OK, BAD_INPUT, CRASH, DIE, SLOW = 1, 2, 3, 4, 5
STEPS = 4                      # steps of an OK request on an entry stage
DOWNSTREAM_SHIFT = 100         # what a downstream copy adds to each token it is fed


@dataclass
class CallLog:
    """What one stage (by name) was asked to do, in order: ("add" | "feed" | "close" |
    "abort", request id, detail)."""
    calls: list[tuple[str, str, object]] = field(default_factory=list)

    def of(self, kind: str) -> list[str]:
        return [rid for k, rid, _ in self.calls if k == kind]


# stage name -> its log; written by the stage threads, read by the test
LOGS: dict[str, CallLog] = defaultdict(CallLog)
_LOCK = threading.Lock()


def _log(stage: str, kind: str, rid: str, detail: object = None) -> None:
    with _LOCK:
        LOGS[stage].calls.append((kind, rid, detail))


@dataclass
class _Job:
    mode: int
    streamed: bool
    pending: list[int] = field(default_factory=list)   # fed, not emitted yet
    closed: bool = False
    done_steps: int = 0


class FakeStage:
    """The StageEngine protocol, with no model behind it."""

    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        self.name = stage.name
        self.jobs: dict[str, _Job] = {}

    def add(self, request: StageRequest) -> None:
        ids = request.prompt_token_ids or []
        mode = ids[0] if ids and not request.streamed else OK
        _log(self.name, "add", request.request_id, list(ids))
        if mode == BAD_INPUT:
            raise InputError("token 2 is refused here", param="prompt")
        self.jobs[request.request_id] = _Job(mode, request.streamed)

    def feed(self, request_id: str, feed: StageFeed) -> None:
        tokens = list(feed.prompt_token_ids or [])
        _log(self.name, "feed", request_id, tokens)
        self.jobs[request_id].pending += tokens

    def close_input(self, request_id: str) -> None:
        _log(self.name, "close", request_id)
        self.jobs[request_id].closed = True

    def abort(self, request_id: str) -> None:
        _log(self.name, "abort", request_id)
        self.jobs.pop(request_id, None)

    def step(self) -> list[StageResult]:
        out = []
        for rid, job in list(self.jobs.items()):
            if job.mode == CRASH:
                raise RuntimeError("the fake stage's step failed")
            if job.mode == DIE:
                raise SystemExit("the fake stage's thread ends")
            res = self._step_streamed(rid, job) if job.streamed else self._step_entry(rid, job)
            if res is not None:
                out.append(res)
                if res.finished:
                    del self.jobs[rid]
        return out

    def _step_entry(self, rid: str, job: _Job) -> StageResult:
        job.done_steps += 1
        if job.mode == SLOW:
            return _tokens(rid, [10 + job.done_steps])
        # progress alone until the end (as a diffusion stage): progress-only events reach
        # only the callers that ask for them
        finished = job.done_steps >= STEPS
        return _tokens(rid, [11, 12, 13, 14][:STEPS] if finished else [], finished=finished,
                       progress=job.done_steps / STEPS)

    def _step_streamed(self, rid: str, job: _Job) -> StageResult | None:
        tokens, job.pending = [t + DOWNSTREAM_SHIFT for t in job.pending], []
        if not tokens and not job.closed:
            return None
        return _tokens(rid, tokens, finished=job.closed)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.jobs)

    def info(self) -> StageInfo:
        return StageInfo(max_model_len=64)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.jobs))


def _tokens(rid: str, tokens: list[int], *, finished: bool = False,
            progress: float | None = None) -> StageResult:
    """A step's result as an AR stage writes it: the tokens for the client, and as the
    payload that travels along the edges."""
    return StageResult(rid, token_ids=tokens, finished=finished,
                       finish_reason="stop" if finished else None, progress=progress,
                       payload=Payload(tokens=TokenDelta(tokens)) if tokens else Payload())


@register_adapter("testing_contract.tokens")
def contract_tokens(data: EdgeData, state: dict) -> StageFeed:
    """Upstream's new tokens, as the downstream fake reads them (the prompt field: the one
    every kind of feed has had)."""
    return StageFeed(prompt_token_ids=list(data.token_ids))


def contract_graph_yaml(tokenizer_dir: str, *, chain: bool) -> str:
    """Fake stages on the in-process backend. chain: `first` feeds `second` (final: text)
    along a chunked edge; else `first` alone (final: text). `tokenizer_dir`: the graph's
    model (the front door loads its tokenizer; the fakes read nothing)."""
    head = f"model: {tokenizer_dir}\nconnector: inproc\nbackend: inproc\nstages:\n"
    first = "  - name: first\n    kind: ar\n    component: fake_stage\n"
    if not chain:
        return head + first + "    final: text\n"
    return head + first + (
        "  - name: second\n    kind: ar\n    component: fake_stage\n"
        "    inputs: [{from: first, adapter: testing_contract.tokens, chunked: true}]\n"
        "    final: text\n")


register_family(ModelFamily(
    "testing_contract", adapters=__name__,
    components=(Component("ar", "fake_stage", f"{__name__}:FakeStage"),)), module=__name__)
