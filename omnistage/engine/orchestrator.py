"""The orchestrator: holds the stage graph and every request's route through it.

It starts the stages (a `StageSet`: processes, sockets, connector; stage_set.py), submits each
request to its entry stages (and pre-registers it on the
downstream stages it needs, parked until their input arrives), routes every StageOutput along
the graph's edges as EdgeChunks, hands final outputs to the request's sink, and propagates
aborts and errors to every stage a request touched. Tensors never pass through it, except the
final ones it hands to the caller.

A stage of several replicas: a request gets one replica per stage when it is added
(replicas.py) and every message about it goes there. A dead replica fails only the requests
it had started (the others go to another replica: _reroute);
the engine is "degraded" while every stage keeps a live replica, unhealthy once one has none;
with `max_restarts` a dead replica restarts in the background, back in service at its Ready.

    caller thread: add_request / abort ----> stage inboxes (PUSH, bound here)
    router thread: outputs (PULL) -> route -> stage inboxes, sinks; watches stage liveness
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref

import zmq
from torch import Tensor

from omnistage.configs.graph import downstream, stages_needed, topological_order, validate_graph
from omnistage.configs.schema import GraphConfig, OutputKind
from omnistage.connectors.base import ChunkKey, Connector
from omnistage.payloads import StageInputs
from omnistage.diffusion_params import DiffusionParams
from omnistage.outputs import RequestEvent, StageMetrics
from omnistage.sampling_params import SamplingParams
from omnistage.stages import adapters
from omnistage.stages import messages as m
from omnistage.stages.info import StageInfo
from omnistage.engine.replicas import Load, ReplicaBook, request_work
from omnistage.engine.route import EntryInputs, Route, Sink, request_image  # noqa: F401
from omnistage.engine.stage_set import POLL_MS, StageSet
from omnistage.errors import StageError
from omnistage.stages.process import check_gpu_placement
from omnistage.utils import trace

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[Orchestrator] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    """Stop every stage at interpreter exit, while the modules they need are still loaded."""
    for orchestrator in list(_LIVE):
        orchestrator.shutdown()


class Orchestrator:
    def __init__(self, graph: GraphConfig, device: str = "auto") -> None:
        validate_graph(graph, adapters=adapters.registered())
        if graph.backend != "inproc" and graph.connector == "inproc":
            raise ValueError("connector: inproc needs backend: inproc (stages in one process)")
        check_gpu_placement(graph, device)
        self.graph = graph
        self.order = topological_order(graph)
        self._downstream = {s.name: downstream(graph, s.name) for s in graph.stages}
        self.healthy = True
        self.dead_reason: str | None = None
        self._routes: dict[str, Route] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._router: threading.Thread | None = None
        self._inputs: Connector | None = None
        self._stages: StageSet | None = None         # None: start-up failed (it cleaned up)
        self.stages = self._stages = StageSet(graph, device)   # every stage started, or an error
        self.replicas = ReplicaBook(graph, self.stages)
        self.stage_info = self.stages.info
        self._connector = self.stages.connector
        self._inputs = self.stages.inputs
        self._router = threading.Thread(target=self._route_loop, name="omnistage-router",
                                        daemon=True)
        self._router.start()
        _LIVE.add(self)

    def _send(self, stage: str, replica: int, msg: m.ToStage) -> None:
        """Send to a replica of a stage. A dead one fails its requests at once, and the message
        is dropped rather than left blocking the router."""
        if not self.stages.send(stage, replica, msg):
            self._check_liveness()

    def _pick_replicas(self, needed: set[str]) -> dict[str, int]:
        self._check_liveness()
        return self.replicas.pick(needed, self.replica_load())

    def replica_load(self) -> Load:
        """Per replica of each stage, the requests routed there and not finished there: the
        steps they asked for and their number."""
        with self._lock:
            load = {name: [[0, 0] for _ in rs] for name, rs in self.stages.runners.items()}
            for route in self._routes.values():
                for name in route.open_stages:
                    slot = load[name][route.replicas[name]]
                    slot[0] += route.work.get(name, 1)
                    slot[1] += 1
        return {name: [(w, n) for w, n in slots] for name, slots in load.items()}

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int] | None,
                    params: dict[str, SamplingParams | DiffusionParams | None], sink: Sink,
                    outputs: set[OutputKind] | None = None,
                    prompt_embeds: Tensor | None = None,
                    prompt_text: str | None = None,
                    multimodal: dict[str, Tensor] | None = None, *,
                    want_progress: bool = False) -> set[str]:
        """Submit a request; returns the stages it will pass through. `multimodal`: tensors
        the entry stage's model takes besides the prompt (audio features, pixels, ...).
        `want_progress`: the sink gets the per-step progress events too (a diffusion stage
        sends one per denoising step; a caller that shows no progress is spared them)."""
        if not self.healthy:
            raise RuntimeError(f"engine is unhealthy: {self.dead_reason}")
        finals = {s.final for s in self.graph.stages if s.final}
        wanted = set(outputs) if outputs else finals
        needed = stages_needed(self.graph, wanted)
        finals_needed = {s.name for s in self.graph.stages
                         if s.name in needed and s.final in wanted}
        entry = EntryInputs(None if prompt_embeds is not None else list(prompt_token_ids or []),
                            prompt_text,
                            StageInputs(prompt_embeds, dict(multimodal or {})).pack(),
                            *request_image(params))
        now = time.time()
        with self._lock:
            if request_id in self._routes:
                raise ValueError(f"request id {request_id!r} is already running")
            route = Route(request_id, sink, needed, set(needed), finals_needed, {},
                          work={name: request_work(self.graph.stage(name), params.get(name))
                                for name in needed}, want_progress=want_progress)
            route.replicas = self._pick_replicas(needed)
            self._routes[request_id] = route
            try:
                for name in reversed(self.order):  # downstream first: parked before input arrives
                    if name in needed:
                        add = self._add_message(request_id, name, route.replicas,
                                                params.get(name), entry, now)
                        route.adds[name] = add
                        self._send(name, route.replicas[name], add)
            except BaseException:   # an input that could not be put: nothing of the request stays
                self._routes.pop(request_id, None)
                self._free(request_id, route.replicas)
                raise
        return needed

    def _add_message(self, request_id: str, name: str, replicas: dict[str, int],
                     p: SamplingParams | DiffusionParams | None, entry: EntryInputs,
                     now: float) -> m.AddRequest:
        """Stage `name`'s part of a request (`replicas`: the request's replica at each stage it
        needs): an entry stage gets the prompt and the client's tensors, a diffusion stage its
        params; what the stage takes as tensors (an edit's image file too: its params carry an
        ImageRef per file) goes through the connector. Every stage gets the prompt's text (a
        downstream stage may encode it beside what its edges bring: GLM-Image's DiT), and every
        other stage the request's image params (`request_image`), and its input image files
        too if the stage takes them (`max_input_images` in its info: GLM-Image's AR stage,
        whose prompt holds the condition images)."""
        ups = [i for i in self.graph.stage(name).inputs if i.source in replicas]
        downs = [d.name for d, _ in self._downstream[name] if d.name in replicas]
        tensors = {} if ups else dict(entry.tensors)
        diffusion = p if isinstance(p, DiffusionParams) else entry.image
        if isinstance(p, DiffusionParams):
            diffusion, files = diffusion.detach_image()
            tensors.update(StageInputs.of_files(files).pack())
        elif self.stage_info.get(name, StageInfo()).max_input_images:
            tensors.update(StageInputs.of_files(entry.image_files).pack())
        edge = m.edge_key(m.CLIENT, name, self._replica_key(name, replicas))
        inputs = self._inputs.put(ChunkKey(request_id, edge, 0), tensors) if tensors else None
        return m.AddRequest(request_id, p if isinstance(p, SamplingParams) else None, diffusion,
                            entry.prompt_text,
                            None if ups else entry.token_ids, inputs, len(ups), downs,
                            {d: replicas[d] for d in downs if self._replica_key(d, replicas)
                             is not None}, now)

    def _replica_key(self, stage: str, replicas: dict[str, int]) -> int | None:
        """The replica a chunk's edge key names for `stage`: None when it has only one."""
        return replicas[stage] if self.graph.stage(stage).placement.replicas > 1 else None

    def abort(self, request_id: str) -> None:
        with self._lock:
            route = self._routes.pop(request_id, None)
            if route is None:
                return
            self._free(request_id, route.replicas)
        route.sink(RequestEvent(request_id, "", done=True, finish_reason="abort",
                                stage_metrics=route.metrics))

    def _free(self, request_id: str, replicas: dict[str, int], finished: bool = False) -> None:
        """Abort a request in its stages (stage -> replica; engine state, parked chunks and
        connector segments are released there) or, once it finished everywhere, free what is
        left of it."""
        msg = m.FreeRequest(request_id) if finished else m.AbortRequest(request_id)
        for name, replica in replicas.items():
            self._send(name, replica, msg)
        # best effort: the request's end reaches its client whatever a release does
        for connector in {id(c): c for c in (self._connector, self._inputs) if c}.values():
            try:   # the client's tensors that no stage took, too
                connector.release(request_id)
            except Exception:
                logger.exception("orchestrator: releasing %s's data failed", request_id)

    def stage_stats(self, timeout_s: float = 10.0) -> dict[str, m.StageStats]:
        """Ask every live replica for its resource state (requests held, free KV blocks, ...).
        Keyed by stage name; a stage of several replicas by `stage#replica`, one key each."""
        with self._lock:
            asked = self.replicas.ask_stats(self._send)
        return self.replicas.wait_stats(asked, timeout_s)

    @property
    def resources(self) -> dict[str, str]:
        """Names of what this engine holds on the host: its ipc folder, its shm prefix."""
        return {"run_dir": self.stages.run_dir, "shm_namespace": self.stages.shm_namespace}

    def stage_pids(self) -> dict[str, int]:
        return self.stages.pids

    @property
    def num_requests(self) -> int:
        return len(self._routes)

    # -- routing -------------------------------------------------------------------------------
    def _route_loop(self) -> None:
        trace.name_thread("router")
        while not self._closed:
            try:
                if self.stages.outputs.poll(POLL_MS):
                    while True:
                        try:
                            raw = self.stages.outputs.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        msg = m.decode_from_stage(raw)
                        if isinstance(msg, m.StageOutput):
                            w0 = time.time()
                            try:
                                self._route(msg)
                            except Exception as exc:   # its request ends, with the error
                                self._route_failed(msg, exc)
                            trace.span("route", w0, stage=msg.stage, request=msg.request_id)
                        elif isinstance(msg, m.LivenessBeat):
                            self.stages.alive(msg)
                        elif isinstance(msg, m.Heartbeat):
                            self.stages.beat(msg)
                        elif isinstance(msg, m.Ready):
                            self._replica_back(msg)
                        elif isinstance(msg, m.StartupFailed):
                            logger.error("orchestrator: %s failed to restart: %s",
                                         self.replicas.who(msg.stage, msg.replica),
                                         msg.error.message)
                        elif isinstance(msg, m.StageStats):
                            self.replicas.got_stats(msg)
                # every waiting message read: the beats are current as of now (a wait for
                # the lock after this must not count as a stage's silence)
                self._check_liveness(read_at=time.monotonic())
            except zmq.ContextTerminated:
                return
            except Exception:  # routing must survive anything one message does
                if self._closed:
                    return
                logger.exception("orchestrator: routing failed")

    def _route_failed(self, out: m.StageOutput, exc: Exception) -> None:
        """Routing a stage's output raised: its request fails with that error (were it left
        routed, its client would wait for an end that never comes); the others go on."""
        logger.exception("orchestrator: routing %s's output of stage %s failed",
                         out.request_id, out.stage)
        with self._lock:
            route = self._routes.get(out.request_id)
            if route is not None:
                self._fail(route, StageError(out.stage, "internal", "internal error routing "
                                             f"stage {out.stage!r}'s output: {exc!r}"))

    def _route(self, out: m.StageOutput) -> None:
        with self._lock:
            route = self._routes.get(out.request_id)
            if route is None:  # aborted or failed meanwhile; the stage was told to free it
                for h in out.handles.values():
                    if h.key.edge.endswith(f"->{m.CLIENT}"):
                        self._connector.release(out.request_id)
                return
            if out.error is not None:
                self._fail(route, out.error)
                return
            route.adds.pop(out.stage, None)          # started there
            tensors = None
            client = out.handles.get(m.edge_name(out.stage, m.CLIENT))
            if client is not None:
                try:
                    tensors = self._connector.get(client)
                except KeyError as exc:   # its segment removed (/dev/shm cleared under us)
                    self._fail(route, StageError(out.stage, "internal", f"output lost: {exc}"))
                    return
            if not self._forward(route, out):
                return
            if out.request_id not in self._routes:  # a dead downstream stage failed it
                return
            if out.finished:
                route.open_stages.discard(out.stage)
                route.metrics[out.stage] = out.metrics or StageMetrics()
                if out.stage in route.finals:
                    route.finish_reason = route.finish_reason or out.finish_reason
            is_final = out.stage in route.finals
            done = not route.open_stages
            if done:
                del self._routes[out.request_id]
                self._free(out.request_id, route.replicas, finished=True)
        progress_only = (out.progress is not None and not out.finished and not out.token_ids
                         and not out.text and tensors is None)
        if done or (is_final and (route.want_progress or not progress_only)):
            route.sink(RequestEvent(
                out.request_id, out.stage, out.token_ids if is_final else [],
                out.text if is_final else "", tensors, out.logprobs if is_final else None,
                out.progress if is_final else None, out.finished and is_final,
                out.finish_reason if is_final else None, done,
                stage_metrics=route.metrics if done else None))

    def _forward(self, route: Route, out: m.StageOutput) -> bool:
        """A stage's output along its edges, as chunks to the downstream stages the request
        needs (an unchunked edge's text gathered until the stage finishes). False: the
        request failed (a chunk lost to a dead replica)."""
        for dest, inp in self._downstream[out.stage]:
            if dest.name not in route.needed:
                continue
            edge = m.edge_name(out.stage, dest.name)
            handle = out.handles.get(edge)
            if not inp.chunked:
                route.whole_text[edge] = route.whole_text.get(edge, "") + out.text
                if not out.finished:
                    continue
                text = route.whole_text.pop(edge)
            elif handle is None and not out.text and not out.finished:
                continue
            else:
                text = out.text
            if self._lost(route, dest.name, handle):
                return False
            idx = route.chunk_idx.get(edge, 0)
            route.chunk_idx[edge] = idx + 1
            route.adds.pop(dest.name, None)      # started there
            self._send(dest.name, route.replicas[dest.name], m.EdgeChunk(
                out.request_id, out.stage, idx, out.finished, text=text, handle=handle))
        return True

    def _fail(self, route: Route, error: StageError) -> None:
        """The request ends with `error` (its stage: the one it names)."""
        if self._routes.pop(route.request_id, None) is None:
            return
        self._free(route.request_id, route.replicas)
        route.sink(RequestEvent(route.request_id, error.stage, done=True, finish_reason="error",
                                error=error, stage_metrics=route.metrics))

    def _check_liveness(self, read_at: float | None = None) -> None:
        """Fail the requests of replicas found dead. The router also (`read_at`: when it had
        read every beat waiting) ends those gone silent: a stopped process, a stuck step."""
        if self._closed:
            return
        with self._lock:    # the router and the callers' threads both look
            if read_at is not None:
                self.stages.end_hung(read_at)
            for name, replica, how in (self.stages.newly_dead()
                                       + self.stages.failed_restarts()):
                self._replica_died(name, replica, how)

    def _replica_died(self, name: str, replica: int, how: str) -> None:
        """Fail the requests the dead replica was given (only those); the engine turns
        unhealthy once the stage has no live replica left. Restarted if the stage allows."""
        who = self.replicas.who(name, replica)
        self.replicas.died(name, replica, how)
        if not self.stages.live(name):
            self.healthy = False
            self.dead_reason = f"{who} {how}"
        logger.error("orchestrator: %s %s; failing its requests", who, how)
        error = f"{who} died ({how})"
        for route in list(self._routes.values()):     # (the caller holds the lock)
            if route.replicas.get(name) == replica and not self._reroute(route, name):
                self._fail(route, StageError(name, "stage_dead", error))

    def _reroute(self, route: Route, name: str) -> bool:
        """Send a request the dead replica of `name` had not started to another live one (the
        replica book says when it can); False where it cannot go."""
        return self.replicas.reroute(route.request_id, route.replicas, route.adds.get(name),
                                     name, self.replica_load(), self._send)

    def _lost(self, route: Route, dest: str, handle: m.TensorHandle | None) -> bool:
        """A chunk that went to a replica the request has left: the request fails (True)."""
        error = self.replicas.lost_chunk(route.replicas, dest, handle)
        if error is not None:
            self._fail(route, StageError(dest, "stage_dead", error))
        return error is not None

    def _replica_back(self, msg: m.Ready) -> None:
        """A restarted replica said Ready: it takes new requests again."""
        with self._lock:
            if not self.stages.ready(msg):
                return
            self.replicas.back(msg.stage, msg.replica)
            if not self.healthy and all(self.stages.live(s.name) for s in self.graph.stages):
                self.healthy, self.dead_reason = True, None

    def replica_status(self) -> dict[str, list[dict[str, int | bool]]]:
        """Each stage's replicas: whether it lives, its outstanding requests (/health,
        /metrics)."""
        return self.replicas.status(self.replica_load())

    @property
    def degraded_reason(self) -> str | None:
        """Why a healthy engine runs short (replicas down, every stage still served), or None."""
        return self.replicas.degraded_reason() if self.healthy else None

    # -- shutdown ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            routes, self._routes = list(self._routes.values()), {}
        for route in routes:
            route.sink(RequestEvent(route.request_id, "", done=True, finish_reason="abort",
                                    error=StageError("", "aborted", "engine shut down")))
        stages = self._stages
        if stages is not None:
            stages.stop()
        if self._router is not None:
            self._router.join(2.0)
        if self._inputs is not None and self._inputs is not self._connector:
            self._inputs.close()
        if stages is not None:
            stages.close()
        trace.save()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
