"""What a stage engine is to the worker: the records that go in and come out, and the
protocol every stage kind implements.

    worker                                      stage engine (ar.py, generation.py, diffusion.py)
    AddRequest  -> StageRequest          ->     add(request)
    EdgeChunk   -> adapter -> StageFeed  ->     feed(request_id, feed); close_input(request_id)
    AbortRequest                         ->     abort(request_id)
    the loop                             ->     step() -> [StageResult]
    Ready handshake                      <-     info() -> StageInfo
    GetStats                             <-     stats() -> EngineStats

`factory.build_stage_engine` builds the one a stage config names. The worker reaches into no
engine: what it needs to know comes through `info()` and `stats()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from omnistage.diffusion.params import DiffusionParams
from omnistage.errors import StageError
from omnistage.payloads import Payload
from omnistage.stages.adapters import StageFeed
from omnistage.stages.info import StageInfo   # (the Ready handshake's facts)
from omnistage.sampling_params import SamplingParams
from omnistage.outputs import StageMetrics


@dataclass(slots=True)
class StageRequest:
    """One request as a stage receives it: every kind reads the inputs it takes (an AR stage
    token ids or embeddings, a diffusion stage the prompt and its params) and refuses a
    request without them."""
    request_id: str
    arrival_time: float
    params: SamplingParams | None = None        # None: the stage's defaults
    diffusion: DiffusionParams | None = None     # non-diffusion stages: the request's, to read
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_embeds: Tensor | None = None
    multimodal: dict[str, Tensor] = field(default_factory=dict)   # StageInputs.multimodal
    streamed: bool = False            # the input comes along edges (feed, then close_input)
    downstream: tuple[str, ...] = ()  # the stages this request goes on to from here


@dataclass(slots=True)
class StageResult:
    """What one step did for one request: new tokens / text, the typed payload for the edges
    and the client (the worker packs it for the connector), and at the end why it finished
    (`error`: the one encoding of a failure; its stage filled in by the worker) and the
    engine's metrics."""
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    payload: Payload = field(default_factory=Payload)   # for the edges / the client
    finished: bool = False
    finish_reason: str | None = None
    error: StageError | None = None
    logprobs: list[dict[int, float]] | None = None
    engine_metrics: StageMetrics | None = None   # its engine's part, once finished
    progress: float | None = None     # share of the work done (diffusion steps)


@dataclass(slots=True)
class EngineStats:
    """A stage engine's load now (requests running and waiting; an AR stage's KV blocks) and
    its totals since start, which the server turns into rates and Prometheus counters."""
    num_running: int
    num_waiting: int = 0               # queued for a batch slot, or parked for their input
    num_free_blocks: int | None = None  # AR: the KV cache
    num_blocks: int | None = None
    num_computed_tokens: int = 0       # AR: prompt and generated tokens run through the model
    num_prefix_query_tokens: int = 0   # AR: prompt tokens looked up in the prefix cache ...
    num_prefix_hit_tokens: int = 0     # ... and found there
    num_preemptions: int = 0           # AR: running requests sent back to wait for blocks

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def kv_usage(self) -> float | None:
        """Share of the KV cache blocks in use (0..1); None for a stage without one."""
        if not self.num_blocks or self.num_free_blocks is None:
            return None
        return 1.0 - self.num_free_blocks / self.num_blocks


class StageEngine(Protocol):
    def add(self, request: StageRequest) -> None: ...
    def feed(self, request_id: str, feed: StageFeed) -> None: ...
    def close_input(self, request_id: str) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def step(self) -> list[StageResult]: ...
    @property
    def has_unfinished_requests(self) -> bool: ...
    def info(self) -> StageInfo: ...
    def stats(self) -> EngineStats: ...
