"""The running stages of one graph: their processes (or threads), the sockets to and from them,
the client's connector, the run folder and the shared-memory namespace. Start-up (start, wait
for every Ready, tell tcp producers their consumers), sending, liveness and tear-down live
here; the orchestrator routes requests on top of it.

A stage of `replicas: N` runs N whole copies (each its own StageRunner, ranks and inbox);
the orchestrator picks one per request. A replica found dead is ended and marked down; the
others serve on.

    StageSet(graph, device)        binds the sockets, starts every replica, waits for Ready
    send(stage, replica, msg)      False if that replica is down (the message is dropped)
    newly_dead()                   replicas found dead since the last call, and how
    live(stage)                    the replicas that take traffic
    restart(stage, replica)        a fresh process for a dead replica; back once its Ready comes
    ready(msg); failed_restarts()  (the router's) a restarted replica came up; or did not
    stop(); close()                replicas told to shut down and joined; then what is left freed
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path

import zmq

from omnistage.configs.graph import downstream
from omnistage.configs.schema import GraphConfig
from omnistage.connectors.base import Connector, make_connector
from omnistage.connectors.shm import new_namespace, sweep
from omnistage.stages import messages as m
from omnistage.stages.process import (StageRunner, WorkerSpec, describe_stage, replica_name,
                                      stage_device)

logger = logging.getLogger(__name__)

POLL_MS = 50
SEND_TIMEOUT_MS = 1000


Replica = tuple[str, int]      # (stage, replica index)


class StageSet:
    def __init__(self, graph: GraphConfig, device: str) -> None:
        self.graph = graph
        self.info: dict[str, dict] = {}               # each stage's Ready.info (replica 0's)
        self.run_dir = tempfile.mkdtemp(prefix="omnistage-")
        self.shm_namespace = new_namespace()
        self.ctx = zmq.Context()
        ipc = graph.backend == "process"
        addr = (lambda n: f"ipc://{self.run_dir}/{n}") if ipc else (
            lambda n: f"inproc://omnistage-{id(self)}-{n}")
        self.outputs = self.ctx.socket(zmq.PULL)      # every stage's outputs, to the router
        self.outputs.bind(addr("out"))
        self.inboxes: dict[str, list[zmq.Socket]] = {}
        self.connector = self._make_connector()
        self._shared = self.connector if graph.connector == "inproc" else None
        self.runners: dict[str, list[StageRunner]] = {}
        self.specs: dict[Replica, WorkerSpec] = {}
        self.down: set[Replica] = set()               # ended replicas: they take no traffic
        self.starting: dict[Replica, float] = {}      # restarted, not Ready yet -> deadline
        try:
            for s in graph.stages:
                self.inboxes[s.name], self.runners[s.name] = [], []
                for r in range(s.replicas):
                    inbox = f"{s.name}.{r}"
                    self.inboxes[s.name].append(self._inbox(addr(inbox)))
                    spec = WorkerSpec(s.name, graph, addr(inbox), addr("out"),
                                      stage_device(device, s.devices_of(r)),
                                      self.shm_namespace, self.run_dir, replica=r)
                    self.specs[(s.name, r)] = spec
                    self.runners[s.name].append(StageRunner(spec, graph.backend, self.ctx,
                                                            self._shared))
            self._wait_ready()
        except BaseException:
            self.stop()
            self.close()
            raise

    def _inbox(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)          # never block on a busy stage ...
        sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)  # ... nor on a dead one
        sock.bind(address)
        return sock

    def _make_connector(self) -> Connector:
        kind = self.graph.connector
        if kind == "shm":
            return make_connector("shm", namespace=self.shm_namespace)
        if kind == "tcp":
            return make_connector("tcp", listen="tcp://127.0.0.1:0")
        return make_connector("inproc")

    def _wait_ready(self) -> None:
        pending = {(name, r) for name, rs in self.runners.items() for r in range(len(rs))}
        deadline = time.monotonic() + max(s.startup_timeout_s for s in self.graph.stages)
        addresses: dict[str, str] = {}
        while pending:
            if time.monotonic() > deadline:
                names = sorted(n if self.graph.stage(n).replicas == 1 else replica_name(n, r)
                               for n, r in pending)
                raise RuntimeError(f"stage(s) {', '.join(names)} did not start within "
                                   "the start-up timeout")
            if self.outputs.poll(POLL_MS):
                msg = m.decode_from_stage(self.outputs.recv())
                if isinstance(msg, m.StartupFailed):
                    raise RuntimeError(f"stage {msg.stage!r} failed to start: {msg.error}")
                if isinstance(msg, m.Ready):
                    pending.discard((msg.stage, msg.replica))
                    if msg.replica == 0:
                        addresses[msg.stage] = msg.connector_address
                        self.info[msg.stage] = dict(msg.info)
                continue
            dead = [p for p in pending if not self.runners[p[0]][p[1]].is_alive()]
            if dead and not self.outputs.poll(POLL_MS):   # its last words may be in flight
                name, r = dead[0]
                raise RuntimeError(f"stage {name!r} failed to start: its process "
                                   f"{self.runners[name][r].exit_description()} before "
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
            self.send(s.name, 0, m.SetPeers(peers))   # tcp: one replica (GraphConfig)

    def send(self, stage: str, replica: int, msg: m.ToStage) -> bool:
        """Send to one replica of a stage; False (the message dropped) if it is down or dead. A
        replica that takes no messages for SEND_TIMEOUT_MS loses this one, and it is logged."""
        if (stage, replica) in self.down or not self.runners[stage][replica].is_alive():
            return False
        try:
            self.inboxes[stage][replica].send(m.encode(msg))
        except zmq.Again:
            logger.warning("orchestrator: stage %s is not taking messages; dropped %s",
                           replica_name(stage, replica), type(msg).__name__)
        return True

    def live(self, stage: str) -> list[int]:
        """The replicas of a stage that take traffic."""
        return [r for r in range(len(self.runners[stage])) if (stage, r) not in self.down]

    def newly_dead(self) -> list[tuple[str, int, str]]:
        """(stage, replica, how it ended) of each replica found no longer running since the
        last call; each is marked down. A replica of several ranks that lost one has its other
        ranks ended (they would wait for the lost one in their next collective)."""
        found = []
        for name, replicas in self.runners.items():
            for r, runner in enumerate(replicas):
                if (name, r) not in self.down and not runner.is_alive():
                    how = runner.exit_description()
                    runner.kill()
                    self.down.add((name, r))
                    found.append((name, r, how))
        return found

    def restart(self, stage: str, replica: int) -> None:
        """Start a fresh process (its ranks) for a down replica, without waiting: it stays down
        until the router hands its Ready to ready(), or failed_restarts() gives it up."""
        assert (stage, replica) in self.down, (stage, replica)
        Path(self.run_dir, f"dist-{stage}-{replica}").unlink(missing_ok=True)  # the old group's
        self.runners[stage][replica] = StageRunner(self.specs[(stage, replica)],
                                                   self.graph.backend, self.ctx, self._shared)
        self.starting[(stage, replica)] = (time.monotonic()
                                           + self.graph.stage(stage).startup_timeout_s)

    def ready(self, msg: m.Ready) -> bool:
        """A restarted replica is up: it takes traffic again. False for any other Ready."""
        if self.starting.pop((msg.stage, msg.replica), None) is None:
            return False
        self.down.discard((msg.stage, msg.replica))
        return True

    def failed_restarts(self) -> list[tuple[str, int, str]]:
        """(stage, replica, why) of each restarted replica that died or ran out of start-up
        time before its Ready; each is ended and stays down."""
        found = []
        for (name, r), deadline in list(self.starting.items()):
            runner = self.runners[name][r]
            if runner.is_alive() and time.monotonic() < deadline:
                continue
            why = ("did not start within the start-up timeout" if runner.is_alive() else
                   f"{runner.exit_description()} while restarting")
            runner.kill()
            del self.starting[(name, r)]
            found.append((name, r, why))
        return found

    @property
    def pids(self) -> dict[str, int]:
        """Each stage's rank-0 process (the one spoken to) of its first replica."""
        return {name: rs[0].pid for name, rs in self.runners.items()}

    @property
    def replica_pids(self) -> dict[str, list[int]]:
        """Each stage's rank-0 process of every replica, in replica order."""
        return {name: [r.pid for r in rs] for name, rs in self.runners.items()}

    @property
    def rank_pids(self) -> dict[str, list[int]]:
        """Every process of each stage: replica by replica, in rank order."""
        return {name: [pid for r in rs for pid in r.pids] for name, rs in self.runners.items()}

    def stop(self) -> None:
        """Tell every stage to shut down and wait for it (or end it)."""
        for socks in self.inboxes.values():
            for sock in socks:
                try:
                    sock.send(m.encode(m.Shutdown()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        for runners in self.runners.values():
            for runner in runners:
                runner.stop()

    def close(self) -> None:
        """Free what the stages leave: the connector, shared memory, sockets, the run folder."""
        self.connector.close()
        if self.graph.connector == "shm":
            sweep(self.shm_namespace)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
