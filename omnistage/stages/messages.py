"""Typed messages between the orchestrator and stage workers (msgspec msgpack over zmq).

    orchestrator -> stage:  AddRequest, EdgeChunk, AbortRequest, FreeRequest, Reroute, SetPeers,
                            GetStats, Shutdown
    stage -> orchestrator:  Ready, StartupFailed, StageOutput, StageStats, Heartbeat (the loop
                            turns), LivenessBeat (the process runs; from every rank)

Bulk tensors never ride in these messages: a `TensorHandle` from the connector does. That
includes the client's inputs (prompt embeddings, multimodal features, an edit's image file),
put by the orchestrator for the stage that takes them (`AddRequest.inputs`).
"""

from __future__ import annotations

import msgspec

from omnistage.connectors.base import TensorHandle
from omnistage.diffusion.params import DiffusionParams
from omnistage.sampling_params import SamplingParams
from omnistage.errors import StageError
from omnistage.stages.info import StageInfo
from omnistage.stages.interface import EngineStats
from omnistage.outputs import StageMetrics


class AddRequest(msgspec.Struct, tag="add", omit_defaults=True):
    request_id: str
    params: SamplingParams | None = None           # ar stages
    # diffusion stages' params (an image: ImageRef); other stages: the request's, to read
    diffusion: DiffusionParams | None = None
    prompt: str | None = None                      # the prompt's text, every stage
    prompt_token_ids: list[int] | None = None      # entry stages
    # the client's tensors for this stage, a packed payloads.StageInputs: prompt embeddings,
    # the model's multimodal inputs, a diffusion stage's input image files (what its params'
    # ImageRefs stand for)
    inputs: TensorHandle | None = None
    num_upstream: int = 0                          # edges that will feed it (parked until then)
    downstream: list[str] = []                     # stages this request flows to from here
    # the replica of each replicated downstream stage that serves it (its chunks' edge key)
    replicas: dict[str, int] = {}
    arrival_time: float = 0.0                      # wall clock (comparable across processes)


class EdgeChunk(msgspec.Struct, tag="chunk", omit_defaults=True):
    """One chunk of an upstream stage's output along one edge (a whole edge sends one)."""

    request_id: str
    source: str                     # upstream stage name
    chunk_idx: int
    is_last: bool
    token_ids: list[int] = []
    text: str = ""
    handle: TensorHandle | None = None


class AbortRequest(msgspec.Struct, tag="abort"):
    """Stop the request (aborted by the client, failed elsewhere): its engine state, parked
    chunks and connector segments go."""
    request_id: str


class FreeRequest(msgspec.Struct, tag="free"):
    """The request is done in every stage: release what is left of it here (the connector
    segments nobody consumed); nothing is aborted."""
    request_id: str


class Reroute(msgspec.Struct, tag="reroute"):
    """A downstream replica of the request died before it started there: its chunks now go to
    `replica` of `stage` (the edge key names it, and a tcp edge its address)."""
    request_id: str
    stage: str
    replica: int


class SetPeers(msgspec.Struct, tag="peers"):
    """tcp and auto connectors: edge key -> consumer address for every edge this stage sends
    by tcp (the whole table: it replaces the last one), known once every stage is up, sent
    again when a replica (re)starts."""

    peers: dict[str, str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class GetStats(msgspec.Struct, tag="get_stats"):
    pass


class StageStats(msgspec.Struct, tag="stats"):
    """A stage's state: requests it holds, its engine's load and totals (EngineStats), what
    the worker counted (steps that moved a request, tokens out), connector counters."""

    stage: str
    num_requests: int                     # requests the worker holds (parked ones included)
    engine: EngineStats
    num_steps: int = 0                    # engine steps that produced an output
    num_output_tokens: int = 0            # tokens the stage produced, all requests
    connector: dict[str, float | int] = {}
    loop: dict[str, float | int] = {}     # the busy loop's counters (StageWorker.loop_stats)
    replica: int = 0

    @property
    def num_engine_requests(self) -> int:
        return self.engine.num_requests

    @property
    def num_free_blocks(self) -> int | None:
        return self.engine.num_free_blocks

    @property
    def num_blocks(self) -> int | None:
        return self.engine.num_blocks


class Ready(msgspec.Struct, tag="ready", omit_defaults=True):
    stage: str
    pid: int
    connector_address: str = ""     # tcp: where this stage receives chunks
    info: StageInfo = StageInfo()
    replica: int = 0
    node: str = ""                  # backend ray: the Ray node it runs on ("": this host)


class StartupFailed(msgspec.Struct, tag="failed"):
    stage: str
    error: StageError             # kind "internal"; its message: the exception, one line
    replica: int = 0


class Heartbeat(msgspec.Struct, tag="beat"):
    """The worker's busy loop still turns (sent every DEADLINE_CHECK_S between steps): a stage
    whose loop goes quiet for its step_timeout_s is stuck in a step that never returns. (A
    stopped process is LivenessBeat's to catch, in seconds.)"""

    stage: str
    replica: int = 0


class LivenessBeat(msgspec.Struct, tag="alive"):
    """A stage process still runs (sent every LIVENESS_PERIOD_S by a thread of its own, every
    rank, whatever its loop does; stages/liveness.py): one that goes quiet for its
    liveness_timeout_s is stopped (SIGSTOP, a frozen host) and is killed."""

    stage: str
    replica: int = 0
    rank: int = 0


class StageOutput(msgspec.Struct, tag="out", omit_defaults=True):
    """What one stage step produced for one request: the client part (text, final tensors) and
    one handle per downstream edge (edge name "src->dst", or "src->client" for final tensors)."""

    stage: str
    request_id: str
    token_ids: list[int] = []
    text: str = ""
    handles: dict[str, TensorHandle] = {}
    logprobs: list[dict[int, float]] | None = None
    progress: float | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: StageError | None = None   # the one encoding of a failure: kind, message, param
    metrics: StageMetrics | None = None     # once finished here


ToStage = (AddRequest | EdgeChunk | AbortRequest | FreeRequest | Reroute | SetPeers | Shutdown
           | GetStats)
FromStage = Ready | StartupFailed | Heartbeat | LivenessBeat | StageOutput | StageStats

_encoder = msgspec.msgpack.Encoder()
_to_stage = msgspec.msgpack.Decoder(ToStage)
_from_stage = msgspec.msgpack.Decoder(FromStage)


def encode(msg: ToStage | FromStage) -> bytes:
    return _encoder.encode(msg)


def decode_to_stage(data: bytes) -> ToStage:
    return _to_stage.decode(data)


def decode_from_stage(data: bytes) -> FromStage:
    return _from_stage.decode(data)


def edge_name(source: str, dest: str) -> str:
    return f"{source}->{dest}"


def edge_key(source: str, dest: str, replica: int | None) -> str:
    """The edge a chunk's key names: `edge_name`, plus `#replica` when the destination stage
    has several (so that a tcp producer finds the address of the one replica it feeds)."""
    return edge_name(source, dest) + ("" if replica is None else f"#{replica}")


def key_replica(edge: str) -> int | None:
    """The replica an edge key names (`edge_key`), None for an edge to a one-replica stage."""
    _, sep, replica = edge.rpartition("#")
    return int(replica) if sep else None


CLIENT = "client"
