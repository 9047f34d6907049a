"""The running stages of one graph: their processes (or threads), the sockets to and from them,
the client's connector, the run folder and the shared-memory namespace. Start-up (start, wait
for every Ready, tell tcp producers their consumers), sending, liveness and tear-down live
here; the orchestrator routes requests on top of it.

    StageSet(graph, device)        binds the sockets, starts every stage, waits for Ready
    send(stage, msg)               False if the stage is dead (the message is dropped)
    dead()                         the first stage that died, and how
    stop(); close()                stages told to shut down and joined; then what is left freed
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time

import zmq

from omnistage.configs.graph import downstream
from omnistage.configs.schema import GraphConfig
from omnistage.connectors.base import Connector, make_connector
from omnistage.connectors.shm import new_namespace, sweep
from omnistage.stages import messages as m
from omnistage.stages.process import StageRunner, WorkerSpec, describe_stage, stage_device

logger = logging.getLogger(__name__)

POLL_MS = 50
SEND_TIMEOUT_MS = 1000


class StageSet:
    def __init__(self, graph: GraphConfig, device: str) -> None:
        self.graph = graph
        self.info: dict[str, dict] = {}               # each stage's Ready.info
        self.run_dir = tempfile.mkdtemp(prefix="omnistage-")
        self.shm_namespace = new_namespace()
        self.ctx = zmq.Context()
        ipc = graph.backend == "process"
        addr = (lambda n: f"ipc://{self.run_dir}/{n}") if ipc else (
            lambda n: f"inproc://omnistage-{id(self)}-{n}")
        self.outputs = self.ctx.socket(zmq.PULL)      # every stage's outputs, to the router
        self.outputs.bind(addr("out"))
        self.inboxes: dict[str, zmq.Socket] = {}
        self.connector = self._make_connector()
        shared = self.connector if graph.connector == "inproc" else None
        self.runners: dict[str, StageRunner] = {}
        try:
            for s in graph.stages:
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)          # never block on a busy stage ...
                sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)  # ... nor on a dead one
                sock.bind(addr(s.name))
                self.inboxes[s.name] = sock
                spec = WorkerSpec(s.name, graph, addr(s.name), addr("out"),
                                  stage_device(device, s.devices), self.shm_namespace,
                                  self.run_dir)
                self.runners[s.name] = StageRunner(spec, graph.backend, self.ctx, shared)
            self._wait_ready()
        except BaseException:
            self.stop()
            self.close()
            raise

    def _make_connector(self) -> Connector:
        kind = self.graph.connector
        if kind == "shm":
            return make_connector("shm", namespace=self.shm_namespace)
        if kind == "tcp":
            return make_connector("tcp", listen="tcp://127.0.0.1:0")
        return make_connector("inproc")

    def _wait_ready(self) -> None:
        pending = set(self.runners)
        deadline = time.monotonic() + max(s.startup_timeout_s for s in self.graph.stages)
        addresses: dict[str, str] = {}
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"stage(s) {', '.join(sorted(pending))} did not start within "
                                   "the start-up timeout")
            if self.outputs.poll(POLL_MS):
                msg = m.decode_from_stage(self.outputs.recv())
                if isinstance(msg, m.StartupFailed):
                    raise RuntimeError(f"stage {msg.stage!r} failed to start: {msg.error}")
                if isinstance(msg, m.Ready):
                    pending.discard(msg.stage)
                    addresses[msg.stage] = msg.connector_address
                    self.info[msg.stage] = dict(msg.info)
                continue
            dead = [name for name in pending if not self.runners[name].is_alive()]
            if dead and not self.outputs.poll(POLL_MS):   # its last words may be in flight
                name = dead[0]
                raise RuntimeError(f"stage {name!r} failed to start: its process "
                                   f"{self.runners[name].exit_description()} before "
                                   "reporting anything (its traceback, if any, is on stderr)")
        for s in self.graph.stages:
            logger.info(describe_stage(s.name, s.kind, self.info.get(s.name, {})))
        if self.graph.connector == "tcp":
            self._tell_peers(addresses)

    def _tell_peers(self, addresses: dict[str, str]) -> None:
        """tcp: each producer learns its consumers' addresses (and the client's), and the
        client each stage's, for the tensors it sends a stage itself (AddRequest.inputs)."""
        client = self.connector.address
        for s in self.graph.stages:
            self.connector.add_peer(m.edge_name(m.CLIENT, s.name), addresses[s.name])
            peers = {m.edge_name(s.name, d.name): addresses[d.name]
                     for d, _ in downstream(self.graph, s.name)}
            if s.final not in (None, "text"):
                peers[m.edge_name(s.name, m.CLIENT)] = client
            self.send(s.name, m.SetPeers(peers))

    def send(self, stage: str, msg: m.ToStage) -> bool:
        """Send to a stage; False (the message dropped) if it is dead. A stage that takes no
        messages for SEND_TIMEOUT_MS loses this one, and it is logged."""
        if not self.runners[stage].is_alive():
            return False
        try:
            self.inboxes[stage].send(m.encode(msg))
        except zmq.Again:
            logger.warning("orchestrator: stage %r is not taking messages; dropped %s",
                           stage, type(msg).__name__)
        return True

    def dead(self) -> tuple[str, str] | None:
        """The first stage that is no longer running and how it ended, or None. A stage of
        several ranks that lost one has its other ranks ended (they would wait for the lost
        one in their next collective)."""
        for name, runner in self.runners.items():
            if not runner.is_alive():
                how = runner.exit_description()
                runner.kill()
                return name, how
        return None

    @property
    def pids(self) -> dict[str, int]:
        """Each stage's rank-0 process (the one spoken to)."""
        return {name: r.pid for name, r in self.runners.items()}

    @property
    def rank_pids(self) -> dict[str, list[int]]:
        """Every process of each stage, in rank order."""
        return {name: r.pids for name, r in self.runners.items()}

    def stop(self) -> None:
        """Tell every stage to shut down and wait for it (or end it)."""
        for sock in self.inboxes.values():
            try:
                sock.send(m.encode(m.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for runner in self.runners.values():
            runner.stop()

    def close(self) -> None:
        """Free what the stages leave: the connector, shared memory, sockets, the run folder."""
        self.connector.close()
        if self.graph.connector == "shm":
            sweep(self.shm_namespace)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
