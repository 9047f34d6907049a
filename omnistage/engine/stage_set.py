"""The running stages of one graph: their processes (or threads), the sockets to and from them,
the client's connectors, the run folder and the shared-memory namespace. Start-up (start, wait
for every Ready, tell tcp producers their consumers), sending, liveness and tear-down live
here; the orchestrator routes requests on top of it. The same for every backend: with ray the
stages are actors on a cluster's nodes (stages/ray_actor.py), reached over tcp from this
node's address instead of ipc sockets, and `connector: auto` crosses nodes by tcp.

A stage of `replicas: N` runs N whole copies (each its own StageRunner, ranks and inbox);
the orchestrator picks one per request. A replica found dead is ended and marked down; the
others serve on.

    StageSet(graph, device)        binds the sockets, starts every replica, waits for Ready
    send(stage, replica, msg)      False if that replica is down (the message is dropped)
    alive(msg); beat(msg)          a rank's liveness beat (its process runs); a replica's
                                   loop heartbeat (its loop turns)
    end_hung(now)                  kill the replicas with a rank silent past liveness_timeout_s
                                   (stopped: seconds) or a loop silent past step_timeout_s (a
                                   step that never returns); newly_dead() reports them
    newly_dead()                   replicas found dead since the last call, and how
    live(stage)                    the replicas that take traffic
    restart(stage, replica)        a fresh process (actor) for a dead replica; back at its Ready
    ready(msg); failed_restarts()  (the router's) a restarted replica came up (its producers
                                   told its address); or did not
    stop(); close()                replicas told to shut down and joined; then what is left freed
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from omnistage.configs.graph import downstream
from omnistage.configs.schema import GraphConfig
from omnistage.connectors.base import Connector, make_connector
from omnistage.connectors.shm import new_namespace, sweep
from omnistage.stages import messages as m
from omnistage.stages.info import StageInfo
from omnistage.stages.process import (StageRunner, WorkerSpec, describe_stage, replica_name,
                                      stage_device)

logger = logging.getLogger(__name__)

POLL_MS = 50
SEND_TIMEOUT_MS = 1000
# The router judges silence every iteration (a poll of POLL_MS, then what came): a longer gap
# between two judgments is its own stall (this process starved of CPU, a long wait for the
# GIL), during which it read no beat, so it counts as nobody's silence.
JUDGE_GAP_S = 0.25


Replica = tuple[str, int]      # (stage, replica index)


@dataclass(frozen=True, slots=True)
class Host:
    node: str     # Ray node id ("" without Ray)
    ip: str       # where this process's sockets bind for the stages


class StageSet:
    def __init__(self, graph: GraphConfig, device: str) -> None:
        self.graph = graph
        self.info: dict[str, StageInfo] = {}          # each stage's Ready.info (replica 0's)
        self.host = self._join_cluster()              # first: nothing to free if it fails
        self.run_dir = tempfile.mkdtemp(prefix="omnistage-")
        self.shm_namespace = new_namespace()
        self.ctx = zmq.Context()
        self.outputs = self.ctx.socket(zmq.PULL)      # every stage's outputs, to the router
        outbox = self._bind(self.outputs, "out")
        self.inboxes: dict[str, list[zmq.Socket]] = {}
        self.connector = self._make_connector()
        self.inputs = self._input_connector()
        self._shared = self.connector if graph.connector_kind == "inproc" else None
        self.runners: dict[str, list[StageRunner]] = {}
        self.specs: dict[Replica, WorkerSpec] = {}
        self.down: set[Replica] = set()               # ended replicas: they take no traffic
        self.starting: dict[Replica, float] = {}      # restarted, not Ready yet -> deadline
        self.addresses: dict[Replica, str] = {}       # each replica's connector address (tcp)
        self.nodes: dict[Replica, str] = {}           # each replica's node (backend ray)
        self.last_beat: dict[Replica, float] = {}     # monotonic: its Ready or last Heartbeat
        self.last_alive: dict[Replica, list[float]] = {}   # per rank: Ready or LivenessBeat
        self._judged_at: float | None = None          # the router's last end_hung
        self._consumers = {s.name: {d.name for d, _ in downstream(graph, s.name)}
                           for s in graph.stages}
        try:
            for s in graph.stages:
                self.inboxes[s.name], self.runners[s.name] = [], []
                for r in range(s.placement.replicas):
                    sock = self._inbox()
                    self.inboxes[s.name].append(sock)
                    spec = WorkerSpec(s.name, graph, self._bind(sock, f"{s.name}.{r}"), outbox,
                                      stage_device(device, s.devices_of(r)),
                                      self.shm_namespace, self.run_dir, replica=r,
                                      driver_node=self.host.node, driver_pid=os.getpid())
                    self.specs[(s.name, r)] = spec
                    self.runners[s.name].append(StageRunner(spec, graph.backend, self.ctx,
                                                            self._shared))
            self._wait_ready()
        except BaseException:
            self.stop()
            self.close()
            raise

    def _join_cluster(self) -> Host:
        """Where the stages reach this process: its Ray node's address (backend ray, the
        cluster joined first), else this host."""
        if self.graph.backend != "ray":
            return Host("", "127.0.0.1")
        from omnistage.stages import ray_actor

        ray_actor.connect(self.graph.ray_address)
        return Host(*ray_actor.driver_node())

    def _bind(self, sock: zmq.Socket, name: str) -> str:
        """Bind a socket the stages connect to: ipc in the run folder (process backend), tcp
        on this node's address and a free port (ray), inproc (inproc). -> its address."""
        if self.graph.backend == "ray":
            sock.bind(f"tcp://{self.host.ip}:*")
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        address = (f"ipc://{self.run_dir}/{name}" if self.graph.backend == "process"
                   else f"inproc://omnistage-{id(self)}-{name}")
        sock.bind(address)
        return address

    def _inbox(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)          # never block on a busy stage ...
        sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)  # ... nor on a dead one
        return sock

    def _make_connector(self) -> Connector:
        kind = self.graph.connector_kind
        if kind == "shm":
            return make_connector("shm", namespace=self.shm_namespace)
        if kind == "tcp":
            return make_connector("tcp", listen=f"tcp://{self.host.ip}:0")
        if kind == "auto":
            return make_connector("auto", namespace=self.shm_namespace,
                                  listen=f"tcp://{self.host.ip}:0")
        return make_connector("inproc")

    def _input_connector(self) -> Connector:
        """Where the client's tensors go to the stages (AddRequest.inputs). Over shm each is a
        segment of its own, never inline in the control message: one per request, where a
        segment's cost does not count. inproc: the stages' own instance; tcp: the client's
        instance, which knows the stages' addresses (_tell_peers)."""
        kind = self.graph.connector_kind
        if kind == "shm":
            return make_connector("shm", namespace=self.shm_namespace, inline_bytes=0)
        if kind == "auto":
            return make_connector("auto", namespace=self.shm_namespace, inline_bytes=0)
        return self.connector

    def _wait_ready(self) -> None:
        pending = {(name, r) for name, rs in self.runners.items() for r in range(len(rs))}
        limits = [s.timeouts.startup_s for s in self.graph.stages]
        # backend inproc builds its stages one at a time (stages/process.py): their times add
        deadline = time.monotonic() + (sum(limits) if self.graph.backend == "inproc"
                                       else max(limits))
        while pending:
            if time.monotonic() > deadline:
                names = sorted(n if self.graph.stage(n).placement.replicas == 1 else replica_name(n, r)
                               for n, r in pending)
                raise RuntimeError(f"stage(s) {', '.join(names)} did not start within "
                                   "the start-up timeout")
            if self.outputs.poll(POLL_MS):
                msg = m.decode_from_stage(self.outputs.recv())
                if isinstance(msg, m.StartupFailed):
                    raise RuntimeError(f"stage {msg.stage!r} failed to start: "
                                       f"{msg.error.message}")
                if isinstance(msg, m.Ready):
                    pending.discard((msg.stage, msg.replica))
                    self._place(msg)
                    if msg.replica == 0:
                        self.info[msg.stage] = msg.info
                continue
            dead = [p for p in pending if not self.runners[p[0]][p[1]].is_alive()]
            if dead and not self.outputs.poll(POLL_MS):   # its last words may be in flight
                name, r = dead[0]
                raise RuntimeError(f"stage {name!r} failed to start: its process "
                                   f"{self.runners[name][r].exit_description()} before "
                                   "reporting anything (its traceback, if any, is on stderr)")
        for s in self.graph.stages:
            logger.info(describe_stage(s.name, s.kind, self.info.get(s.name, StageInfo())))
        self._tell_peers()

    def _place(self, msg: m.Ready) -> None:
        """Note where a replica that said Ready receives chunks, and on which node."""
        self.addresses[(msg.stage, msg.replica)] = msg.connector_address
        self.nodes[(msg.stage, msg.replica)] = msg.node
        now = time.monotonic()
        self.last_beat[(msg.stage, msg.replica)] = now
        self.last_alive[(msg.stage, msg.replica)] = \
            [now] * self.graph.stage(msg.stage).parallel.world_size

    def beat(self, msg: m.Heartbeat) -> None:
        self.last_beat[(msg.stage, msg.replica)] = time.monotonic()

    def alive(self, msg: m.LivenessBeat) -> None:
        ranks = self.last_alive.get((msg.stage, msg.replica))
        if ranks is not None and msg.rank < len(ranks):
            ranks[msg.rank] = time.monotonic()

    def end_hung(self, now: float) -> None:
        """SIGKILL every rank of each running replica found silent at `now` (a stopped process
        takes no SIGTERM): its requests would wait forever. newly_dead() then reports it. Only
        the router calls this, `now` the moment it had read every message waiting: a beat not
        read yet must not count as silence, nor does a stall of the router's own (JUDGE_GAP_S):
        after one, the beats that came meanwhile may still be on their way in. Threads
        (backend inproc) cannot be ended."""
        stalled = 0.0 if self._judged_at is None else now - self._judged_at - JUDGE_GAP_S
        self._judged_at = now
        if stalled > 0:
            for replica, seen in self.last_beat.items():
                self.last_beat[replica] = seen + stalled
                self.last_alive[replica] = [t + stalled for t in self.last_alive[replica]]
        for replica in self.last_beat:
            runner = self.runners[replica[0]][replica[1]]
            if (replica in self.down or replica in self.starting or not runner.processes
                    or runner.hung is not None or not runner.is_alive()):
                continue
            why = self._silence(replica, now)
            if why is not None:
                logger.error("orchestrator: stage %s %s; killing it",
                             replica_name(*replica), why)
                runner.kill_hung(why)

    def _silence(self, replica: Replica, now: float) -> str | None:
        """Why a replica counts as hung, or None: a rank whose process sent no liveness beat
        for its stage's liveness_timeout_s is stopped (SIGSTOP, a frozen host; a long step
        beats on); a loop that sent no heartbeat for step_timeout_s is stuck in a step."""
        stage = self.graph.stage(replica[0])
        runner = self.runners[replica[0]][replica[1]]
        for rank, seen in enumerate(self.last_alive[replica]):
            # a local process /proc shows running is busy, not stopped: its step is held
            # to step_timeout_s below
            if now - seen > stage.timeouts.liveness_s and runner.rank_stopped(rank) is not False:
                of = f" from rank {rank}" if stage.parallel.world_size > 1 else ""
                return (f"stopped answering (no liveness beat{of} for "
                        f"{stage.timeouts.liveness_s:g} s)")
        if now - self.last_beat[replica] > stage.timeouts.step_s:
            return f"hung (no heartbeat for {stage.timeouts.step_s:g} s)"
        return None

    def _tell_peers(self) -> None:
        """tcp and auto: each replica learns the address of every consumer it sends to by tcp
        (all of them with tcp; with auto, those on another node), and the client the stages'
        (for the tensors it sends a stage itself, AddRequest.inputs). Sent again whenever a
        replica (re)starts: its address is new."""
        if self.graph.connector_kind not in ("tcp", "auto"):
            return
        for conn in {id(c): c for c in (self.connector, self.inputs)}.values():
            conn.set_peers(self.peers_of(m.CLIENT, 0))  # type: ignore[attr-defined]
        for s, r in self.addresses:
            if (s, r) not in self.down:
                self.send(s, r, m.SetPeers(self.peers_of(s, r)))

    def peers_of(self, stage: str, replica: int) -> dict[str, str]:
        """Edge key -> consumer address of each edge that one replica of `stage` (or the
        client, m.CLIENT) sends by tcp: every edge with connector tcp; with auto, the edges to
        another node."""
        node = self.host.node if stage == m.CLIENT else self.nodes[(stage, replica)]
        tcp_only = self.graph.connector_kind == "tcp"
        consumers = ({s.name for s in self.graph.stages} if stage == m.CLIENT
                     else self._consumers[stage])
        peers = {m.edge_key(stage, d, r if self.graph.stage(d).placement.replicas > 1 else None): address
                 for (d, r), address in self.addresses.items()
                 if d in consumers and (d, r) not in self.down
                 and (tcp_only or self.nodes[(d, r)] != node)}
        if stage != m.CLIENT and self.graph.stage(stage).final not in (None, "text") \
                and (tcp_only or node != self.host.node):
            peers[m.edge_name(stage, m.CLIENT)] = self.connector.address
        return peers

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
                                           + self.graph.stage(stage).timeouts.startup_s)

    def ready(self, msg: m.Ready) -> bool:
        """A restarted replica is up: it takes traffic again, and its producers learn its
        address. False for any other Ready."""
        if self.starting.pop((msg.stage, msg.replica), None) is None:
            return False
        self.down.discard((msg.stage, msg.replica))
        self._place(msg)
        self._tell_peers()
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
        if self.inputs is not self.connector:
            self.inputs.close()
        self.connector.close()
        if self.graph.connector_kind in ("shm", "auto"):
            sweep(self.shm_namespace)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
