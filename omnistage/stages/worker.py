"""The stage worker: one stage's engine, connector and edges, and the busy loop around them.

    loop:  take every pending message (add / chunk / abort / free / peers / shutdown)
           step() the engine once
           send one StageOutput per request that moved (client part + a handle per edge)

A step that waits for the device (the talker's frame) handles the inbox's EdgeChunks during
the wait (`_chunk_in_wait`, utils/device_wait.py) instead of after it.

The same worker runs in its own process (process backend) or in a thread of the caller
(inproc backend); only the sockets' addresses differ.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec
import torch
import zmq
from torch import Tensor

from omnistage.configs.graph import downstream
from omnistage.configs.schema import GraphConfig, StageConfig
from omnistage.errors import StageError
from omnistage.connectors.base import ChunkKey, Connector
from omnistage.payloads import Payload, StageInputs
from omnistage.stages.adapters import EdgeData, get_adapter
from omnistage.stages import messages as m
from omnistage.stages.factory import build_stage_engine
from omnistage.stages.faults import StepFaults
from omnistage.stages.interface import StageEngine, StageRequest, StageResult
from omnistage.utils import device_wait, trace
from omnistage.outputs import StageMetrics

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 5
DEADLINE_CHECK_S = 0.5  # how often waits for upstream input are checked against their deadline
                       # (and a Heartbeat sent: the loop still turns)
GATHER_GAP_MS = 1      # `_gather`: the burst ends after this long without a message
GATHER_MAX_MS = 4
# the messages about one request: they carry its id
PER_REQUEST = (m.AddRequest, m.EdgeChunk, m.AbortRequest, m.FreeRequest, m.Reroute)


@dataclass(slots=True)
class RequestState:
    """What the worker keeps per request besides the engine's own state."""

    request_id: str
    downstream: list[str]                       # stages this request flows to from here
    replicas: dict[str, int]                    # replicated downstream stage -> its replica
    open_sources: set[str]                      # upstream edges not finished yet
    adapter_state: dict[str, dict] = field(default_factory=dict)
    chunk_idx: dict[str, int] = field(default_factory=dict)
    whole: dict[str, list[dict[str, Tensor]]] = field(default_factory=dict)  # whole-edge buffers
    arrival_time: float = 0.0
    last_input: float = 0.0                     # monotonic: added, or its latest chunk
    first_output_time: float | None = None
    num_tokens: int = 0
    num_outputs: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    connector_seconds: float = 0.0


class StageWorker:
    def __init__(self, stage: StageConfig, graph: GraphConfig, connector: Connector,
                 device: str, replica: int = 0) -> None:
        self.stage = stage
        self.name = stage.name
        self.replica = replica
        self.connector = connector
        self.engine: StageEngine = build_stage_engine(stage, graph.model, device)
        self.out_edges = {dst.name: inp.chunked for dst, inp in downstream(graph, stage.name)}
        self.adapters = {inp.source: get_adapter(inp.adapter) for inp in stage.inputs}
        self.final = stage.final
        self.requests: dict[str, RequestState] = {}
        self.faults = StepFaults.from_env(self.name, replica)   # None outside fault tests
        # a step's device wait handles inbox chunks (`_chunk_in_wait`): the first other message
        # it meets waits here; request drops it causes wait for the step's end
        self._inbox: zmq.Socket | None = None
        self._outbox: zmq.Socket | None = None
        self._deferred: m.ToStage | None = None
        self._stepping = False
        self._pending_drops: list[tuple[str, bool]] = []
        # where the busy loop's time goes: messages handled, steps run (seconds, counts)
        self.loop_stats: dict[str, float | int] = {
            "num_messages": 0, "message_seconds": 0.0, "max_message_seconds": 0.0,
            "num_steps": 0, "step_seconds": 0.0, "max_step_seconds": 0.0}
        self.num_output_steps = 0      # steps that produced an output (the rate the log shows)
        self.num_output_tokens = 0

    # -- messages ------------------------------------------------------------------------------
    def handle(self, msg: m.ToStage) -> list[m.StageOutput | m.StageStats]:
        """Apply one message; a request-level failure becomes an error output, never a raise."""
        rid = msg.request_id if isinstance(msg, PER_REQUEST) else None
        try:
            if isinstance(msg, m.AddRequest):
                self._add(msg)
            elif isinstance(msg, m.EdgeChunk):
                self._chunk(msg)
            elif isinstance(msg, m.AbortRequest):
                self._drop(msg.request_id, abort=True)
            elif isinstance(msg, m.FreeRequest):   # done everywhere: here too, unless a bug
                self._drop(msg.request_id, abort=msg.request_id in self.requests)
            elif isinstance(msg, m.GetStats):
                return [self.stats()]
            elif isinstance(msg, m.Reroute):
                if msg.request_id in self.requests:
                    self.requests[msg.request_id].replicas[msg.stage] = msg.replica
            elif isinstance(msg, m.SetPeers):
                self.connector.set_peers(msg.peers)  # type: ignore[attr-defined]
            return []
        except Exception as exc:
            if rid is None or rid not in self.requests:
                if isinstance(msg, m.AddRequest):   # refused at the door: bad input if ValueError
                    return [m.StageOutput(self.name, msg.request_id, finished=True,
                                          finish_reason="error",
                                          error=StageError.from_exception(self.name, exc))]
                logger.exception("stage %s: message %s failed", self.name, type(msg).__name__)
                return []
            self._drop(rid, abort=True)
            return [m.StageOutput(self.name, rid, finished=True, finish_reason="error",
                                  error=StageError(self.name, "internal", _describe(exc)))]

    def _add(self, msg: m.AddRequest) -> None:
        if msg.request_id in self.requests:
            raise ValueError(f"request id {msg.request_id!r} is already in stage {self.name}")
        unknown = [d for d in msg.downstream if d not in self.out_edges]
        assert not unknown, f"stage {self.name} has no edge to {unknown}"
        state = RequestState(request_id=msg.request_id, downstream=list(msg.downstream),
                             replicas=dict(msg.replicas),
                             open_sources=set(self.adapters) if msg.num_upstream else set(),
                             arrival_time=msg.arrival_time or time.time(),
                             last_input=time.monotonic())
        request = StageRequest(msg.request_id, state.arrival_time, msg.params, msg.diffusion,
                               msg.prompt, msg.prompt_token_ids, streamed=msg.num_upstream > 0,
                               downstream=tuple(msg.downstream))
        if msg.inputs is not None:   # the client's tensors: embeddings, multimodal inputs
            inputs = StageInputs.unpack(self._get(state, msg.inputs))
            request.prompt_embeds, request.multimodal = inputs.prompt_embeds, inputs.multimodal
        self.engine.add(request)
        self.requests[msg.request_id] = state

    def _chunk(self, msg: m.EdgeChunk) -> None:
        state = self.requests.get(msg.request_id)
        if state is None:   # finished here or aborted meanwhile: drop this chunk's data (only
            if msg.handle is not None:  # it: the request's other chunks may still be in use)
                self.connector.discard(msg.handle)
            return
        state.last_input = time.monotonic()
        payload = Payload.unpack(self._get(state, msg.handle)) if msg.handle is not None \
            else Payload()
        token_ids = payload.tokens.token_ids if payload.tokens is not None else []
        data = EdgeData(msg.request_id, msg.source, msg.chunk_idx, msg.is_last, token_ids,
                        msg.text, payload)
        feed = self.adapters[msg.source](data, state.adapter_state.setdefault(msg.source, {}))
        if feed is not None:
            self.engine.feed(msg.request_id, feed)
        if msg.is_last:
            state.open_sources.discard(msg.source)
            if not state.open_sources:
                self.engine.close_input(msg.request_id)

    def _get(self, state: RequestState, handle: m.TensorHandle) -> dict[str, Tensor]:
        t0 = time.perf_counter()
        tensors = self.connector.get(handle)
        state.connector_seconds += time.perf_counter() - t0
        state.bytes_in += handle.nbytes
        return tensors

    def _drop(self, request_id: str, abort: bool) -> None:
        self.requests.pop(request_id, None)
        if self._stepping:   # a chunk that failed in a step's device wait: the engine is
            self._pending_drops.append((request_id, abort))   # mid-step, so after it
            return
        if abort:
            self.engine.abort(request_id)
        self.connector.release(request_id)

    def _drop_pending(self) -> None:
        drops, self._pending_drops = self._pending_drops, []
        for request_id, abort in drops:
            self._drop(request_id, abort)

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[m.StageOutput]:
        outputs = []
        if self.faults is not None:
            self.faults.before_step()
        results = self.engine.step()
        w0 = time.time()
        self.num_output_steps += bool(results)
        for res in results:
            state = self.requests.get(res.request_id)
            if state is None:
                continue
            outputs.append(self._output(res, state))
            if res.finished:
                del self.requests[res.request_id]
        trace.span("outputs", w0)
        return outputs

    def _output(self, res: StageResult, state: RequestState) -> m.StageOutput:
        now = time.time()
        if res.token_ids or res.payload:
            state.first_output_time = state.first_output_time or now
            state.num_outputs += 1
        state.num_tokens += len(res.token_ids)
        self.num_output_tokens += len(res.token_ids)
        out = m.StageOutput(self.name, res.request_id, token_ids=res.token_ids, text=res.text,
                            logprobs=res.logprobs, progress=res.progress,
                            finished=res.finished,
                            finish_reason=res.finish_reason,
                            error=None if res.error is None else res.error.at(self.name))
        if res.error is None:
            payload = res.payload.pack()   # the connector's form, once
            for dest in state.downstream:
                edge = m.edge_name(self.name, dest)
                if self.out_edges[dest]:   # chunked: every step's payload travels now
                    if payload:
                        out.handles[edge] = self._put(state, dest, payload)
                else:                      # whole: collected, sent once at the end
                    if payload:
                        state.whole.setdefault(dest, []).append(payload)
                    if res.finished and state.whole.get(dest):
                        out.handles[edge] = self._put(state, dest, _concat(state.whole.pop(dest)))
            if self.final not in (None, "text") and payload:
                out.handles[m.edge_name(self.name, m.CLIENT)] = self._put(state, m.CLIENT,
                                                                          payload)
        if res.finished:
            # wall-clock times (comparable across processes) and durations in seconds
            first = state.first_output_time
            out.metrics = msgspec.structs.replace(
                res.engine_metrics or StageMetrics(),
                arrival_time=state.arrival_time, first_output_time=first, finished_time=now,
                time_in_stage=now - state.arrival_time,
                time_to_first_output=None if first is None else first - state.arrival_time,
                num_tokens=state.num_tokens, num_outputs=state.num_outputs,
                connector_bytes_in=state.bytes_in, connector_bytes_out=state.bytes_out,
                connector_seconds=state.connector_seconds)
        return out

    def _put(self, state: RequestState, dest: str, tensors: dict[str, Tensor]) -> m.TensorHandle:
        """One chunk to `dest` (a stage or the client), keyed to the replica that serves the
        request there."""
        edge = m.edge_name(self.name, dest)
        idx = state.chunk_idx.get(edge, 0)
        state.chunk_idx[edge] = idx + 1
        t0 = time.perf_counter()
        key = ChunkKey(state.request_id, m.edge_key(self.name, dest, state.replicas.get(dest)),
                       idx)
        handle = self.connector.put(key, tensors)
        state.connector_seconds += time.perf_counter() - t0
        state.bytes_out += handle.nbytes
        return handle

    def stats(self) -> m.StageStats:
        st = self.connector.stats
        return m.StageStats(
            self.name, len(self.requests), self.engine.stats(), self.num_output_steps,
            self.num_output_tokens,
            {"bytes_put": st.bytes_put, "bytes_got": st.bytes_got, "num_put": st.num_put,
             "num_get": st.num_get, "put_seconds": st.put_seconds,
             "get_seconds": st.get_seconds}, dict(self.loop_stats), self.replica)

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests

    # -- the loop --------------------------------------------------------------------------------
    def serve(self, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        """Run until Shutdown: messages first, then one step."""
        trace.name_thread(self.name)
        self._inbox, self._outbox = inbox, outbox
        idle = True
        next_check = time.monotonic() + DEADLINE_CHECK_S
        while True:
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + DEADLINE_CHECK_S
                outbox.send(m.encode(m.Heartbeat(self.name, self.replica)))
                for out in self.expire_stalled():
                    outbox.send(m.encode(out))
            if self._deferred is not None:   # met during the last step's device wait
                msg, self._deferred = self._deferred, None
                if not self._receive(msg):
                    return
            was_idle = not self.has_work
            timeout = IDLE_POLL_MS if idle or was_idle else 0
            if inbox.poll(timeout):
                if not self._drain() or (was_idle and self.has_work and not self._gather()):
                    return
            idle = not self._step_once() if self.has_work else True

    def expire_stalled(self, now: float | None = None) -> list[m.StageOutput]:
        """Fail the requests still waiting for upstream input that has not come for the
        stage's input_timeout_s (an upstream that died or went silent): kind "timeout"."""
        now = time.monotonic() if now is None else now
        limit = self.stage.timeouts.input_s
        outs = []
        for rid, state in list(self.requests.items()):
            if not state.open_sources or now - state.last_input <= limit:
                continue
            waited = ", ".join(sorted(state.open_sources))
            message = f"no input from {waited} for {limit:g} s"
            logger.warning("stage %s: request %s: %s; failing it", self.name, rid, message)
            self._drop(rid, abort=True)
            outs.append(m.StageOutput(self.name, rid, finished=True, finish_reason="error",
                                      error=StageError(self.name, "timeout", message)))
        return outs

    def _drain(self) -> bool:
        """Handle every message waiting in the inbox; False on Shutdown."""
        while True:
            try:
                raw = self._inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if not self._receive(m.decode_to_stage(raw)):
                return False

    def _gather(self) -> bool:
        """Work arrived at an idle stage: take what else comes in the same burst (clients that
        send several requests at once reach a stage a fraction of a millisecond apart) before
        the first step, so they share one prefill instead of waiting behind it. Waits at most
        GATHER_GAP_MS after the last message, GATHER_MAX_MS in all; False on Shutdown."""
        deadline = time.monotonic() + GATHER_MAX_MS / 1e3
        while time.monotonic() < deadline and self._inbox.poll(GATHER_GAP_MS):
            if not self._drain():
                return False
        return True

    def _step_once(self) -> bool:
        """One engine step, its device waits used for the inbox's chunks; True if it output."""
        t0, w0 = time.perf_counter(), time.time()
        with device_wait.idle_work(self._chunk_in_wait):
            self._stepping = True
            failed: Exception | None = None
            try:
                outs = self.step()
            except Exception as exc:
                if self.stage.parallel.world_size > 1:   # the ranks' collectives may be out
                    raise                                # of step: the stage ends (restart)
                outs, failed = [], exc
            finally:
                self._stepping = False
                self._drop_pending()
        if failed is not None:   # after the drops the step deferred
            outs = self._fail_step(failed)
        for out in outs:
            self._outbox.send(m.encode(out))
        self._count("step", time.perf_counter() - t0)
        if trace.enabled() and outs:
            trace.span("step", w0, outputs=[o.request_id for o in outs])
        return bool(outs)

    def _fail_step(self, exc: Exception) -> list[m.StageOutput]:
        """A step that raised past the engine's own per-request isolation (out of memory, a
        bug): nothing says which request caused it, so every request the stage holds fails
        with the error and is freed here, and the stage serves on. (Crashing instead would
        fail the same requests and leave the stage dead until a restart.) A stage of several
        ranks ends instead: its other ranks may be waiting in a collective that never comes."""
        logger.exception("stage %s: a step failed; failing its %d request(s)", self.name,
                         len(self.requests))
        outs = []
        for rid in list(self.requests):
            self._drop(rid, abort=True)
            outs.append(m.StageOutput(self.name, rid, finished=True, finish_reason="error",
                                      error=StageError(self.name, "internal", _describe(exc))))
        return outs

    def _receive(self, msg: m.ToStage) -> bool:
        """Handle one message and send what it answers; False on Shutdown."""
        if isinstance(msg, m.Shutdown):
            return False
        t0, w0 = time.perf_counter(), time.time()
        for out in self.handle(msg):
            self._outbox.send(m.encode(out))
        self._count("message", time.perf_counter() - t0)
        if trace.enabled():
            trace.span(type(msg).__name__, w0,
                       request=msg.request_id if isinstance(msg, PER_REQUEST) else None,
                       chunk=msg.chunk_idx if isinstance(msg, m.EdgeChunk) else None)
        return True

    def _chunk_in_wait(self) -> bool:
        """Idle work while a step waits for the device (utils/device_wait.py): handle the next
        message if it is an EdgeChunk, which only records input for the next step. Any other
        message (an add, an abort) waits for the step's end, and so does everything after it,
        so messages still apply in order."""
        if self._deferred is not None:
            return False
        try:
            raw = self._inbox.recv(zmq.NOBLOCK)
        except zmq.Again:
            return False
        msg = m.decode_to_stage(raw)
        if not isinstance(msg, m.EdgeChunk):
            self._deferred = msg
            return False
        return self._receive(msg)

    def _count(self, what: str, seconds: float) -> None:
        st = self.loop_stats
        st[f"num_{what}s"] += 1
        st[f"{what}_seconds"] += seconds
        st[f"max_{what}_seconds"] = max(st[f"max_{what}_seconds"], seconds)


def _concat(chunks: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Join a request's step payloads: rows concatenate; 0-d tensors keep their last value."""
    keys = list(dict.fromkeys(k for c in chunks for k in c))
    out: dict[str, Tensor] = {}
    for key in keys:
        parts = [c[key] for c in chunks if key in c]
        out[key] = parts[-1] if parts[0].dim() == 0 else torch.cat(parts)
    return out


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
