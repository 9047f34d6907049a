"""Stages as Ray actors (backend ray): the launcher that puts each stage rank on a cluster node.

    serving process (driver)                        node B
    Orchestrator ── StageSet ── tcp zmq ──────────> StageActor (Ray worker; holds the GPU share)
                    │  RayRank: the actor's handle    └─ child: python -m omnistage.stages.entry
                    │  and its wait() ref                  (process_main, the same stage process
                    │                                       as the process backend's)

One actor per rank of each replica. The actor is only a holder: it owns the stage's resources
in Ray's books (its GPU share `ray_gpus`, the stage's `ray_resources`) and starts the very stage process the
process backend starts, as its child; its one call, `wait()`, returns when that process ends.
Why a child and not the stage loop inside the actor: Ray ends the actors of a dead driver (and
`ray.kill`) with a forced exit in which no clean-up of ours runs; the child keeps the process
backend's parent-death guarantee (PR_SET_PDEATHSIG plus a watchdog), so when its actor goes, it
frees its shared-memory segments and exits. The ranks of one replica share a placement group
(STRICT_PACK: one node), so they meet through a file rendezvous on that node.

Control messages stay our typed msgspec structs over zmq, now tcp to the driver's node instead
of ipc://. Measured (omnistage/benchmarks/control_latency.py, one 2-core CPU host, an EdgeChunk
round trip orchestrator -> stage -> orchestrator, median / p99): zmq ipc 77 / 136 us, zmq tcp
81 / 138 us, a Ray actor call 601 / 1068 us. The talker and code2wav exchange one message per
request per step, so a Ray call would add about half a millisecond to each, and a stage would
need a threaded actor to take calls while its loop steps; zmq keeps the busy loop, its gathering
of bursts, and the StageSet's liveness checks and restarts those of the process backend.
Liveness is the `wait()` call's future: done means the stage process (or its actor, or its
node) ended.

Restarts are ours (StageSet.restart starts a fresh actor), not Ray's max_restarts: a restarted
stage must say Ready again, and its new tcp address must reach its producers (SetPeers), which
the StageSet already does for both backends; Ray's restart would re-run the actor's __init__
behind our back.

Actors are not detached: they belong to the driver's job, and Ray ends them (and their
placement groups) when the serving process exits or is killed. A local cluster the serving
process started (no address) ends with it too, Ray's daemons included: ray_reaper.py.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnistage.configs.schema import StageConfig
from omnistage.registry import FAMILY_MODULES_ENV

if TYPE_CHECKING:
    from omnistage.stages.launch import WorkerSpec

PLACEMENT_TIMEOUT_S = 60.0


def require_ray() -> Any:
    """The ray module, or an ImportError that says how to get it."""
    try:
        import ray
    except ImportError:
        raise ImportError("backend: ray needs Ray, which is not installed: pip install "
                          "'omnistage[ray]' (or pip install 'ray[default]'), or use "
                          "backend: process") from None
    return ray


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` (None: RAY_ADDRESS or a running `ray start`, else a
    new local cluster) unless this process already has. A cluster started here ends with this
    process, however it ends: a reaper, started first so that a death during ray.init is
    covered too, learns the cluster's session folder (or that there is none of ours)."""
    ray = require_ray()
    if ray.is_initialized():
        return
    reaper = start_reaper(os.path.dirname(ray.__file__))
    ray.init(address=address, include_dashboard=False, log_to_driver=True)
    node = ray._private.worker._global_node
    tell_reaper(reaper, node.get_session_dir_path() if node.head else None)


_reapers: list[subprocess.Popen] = []    # held for this process's life (one per ray.init)


def start_reaper(ray_dir: str) -> subprocess.Popen:
    """A process (ray_reaper.py, a session of its own) that waits for this one to end, then
    ends the processes of the Ray session it is told of; `ray_dir`: Ray's package folder."""
    reaper = subprocess.Popen(
        [sys.executable, "-I", str(Path(__file__).with_name("ray_reaper.py")),
         str(os.getpid()), ray_dir],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True, text=True)
    _reapers.append(reaper)
    return reaper


def tell_reaper(reaper: subprocess.Popen, session_dir: str | None) -> None:
    """One line: the session folder of the cluster this process started, or empty (None:
    it joined one it did not start; the reaper ends)."""
    assert reaper.stdin is not None, "told already"
    reaper.stdin.write(f"{session_dir or ''}\n")
    reaper.stdin.close()
    reaper.stdin = None


def driver_node() -> tuple[str, str]:
    """(node id, IP address) of this process's node: the orchestrator's sockets bind there."""
    ray = require_ray()
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


@functools.cache
def _actor_class() -> Any:
    """The actor class, made once per process (Ray exports each class it is given)."""
    ray = require_ray()

    class StageActor:
        """Holds one stage rank's resources on its node; its child process is the stage."""

        def __init__(self, spec: WorkerSpec) -> None:
            from omnistage.stages.launch import start_stage_process

            self.spec = replace(spec, node=ray.get_runtime_context().get_node_id(),
                                tcp_host=ray.util.get_node_ip_address(),
                                device=_visible_device(spec.device),
                                shm_tag=secrets.token_hex(3))
            Path(self.spec.run_dir).mkdir(parents=True, exist_ok=True)
            self.process = start_stage_process(self.spec, new_session=True)

        def where(self) -> tuple[str, int]:
            """(node id, the stage process's pid there)."""
            return self.spec.node, self.process.pid

        def wait(self) -> int:
            """The stage process's exit code, once it ends (its rendezvous folder gone)."""
            code = self.process.wait()
            shutil.rmtree(self.spec.run_dir, ignore_errors=True)
            return code

    return ray.remote(StageActor)


def _visible_device(device: str) -> str:
    """Ray shows an actor only its own GPU (CUDA_VISIBLE_DEVICES): it is cuda:0 there."""
    return "cuda:0" if device.startswith("cuda") else device


class RayRank:
    """The driver's hold on one stage rank's actor, shaped like the subprocess.Popen the
    process backend holds (poll, returncode, terminate, kill, wait), so StageRunner and
    StageSet treat both alike."""

    def __init__(self, actor: Any, stage: str, group: Any) -> None:
        self.actor = actor
        self.stage = stage
        self.group = group          # the replica's placement group (shared by its ranks)
        # asked before wait(), which holds the actor's one thread for the stage's life
        self._where_ref = actor.where.remote()
        self._done: Future = actor.wait.remote().future()
        self.returncode: int | None = None
        self.ended: str | None = None     # how it ended, where the exit code cannot say
        self._where: tuple[str, int] | None = None

    @property
    def pid(self) -> int:
        """The stage process's pid on its node."""
        return self.where[1]

    @property
    def node(self) -> str:
        return self.where[0]

    @property
    def where(self) -> tuple[str, int]:
        if self._where is None:
            self._where = require_ray().get(self._where_ref, timeout=PLACEMENT_TIMEOUT_S)
        return self._where

    def poll(self) -> int | None:
        """None while the stage process runs; its exit code (or -9 and `ended` said: its actor
        was killed, its node lost) once it ended."""
        if self.returncode is None and self._done.done():
            exc = self._done.exception()
            self.returncode = -9 if exc is not None else self._done.result()
            if exc is not None:
                self.ended = f"lost its Ray actor ({type(exc).__name__})"
            self.terminate()       # the actor outlives its process: its resources go now
        return self.returncode

    def terminate(self) -> None:
        """End the actor (its stage process gets SIGTERM from its parent's death and cleans
        up) and give back its placement group."""
        ray = require_ray()
        from ray.util.placement_group import remove_placement_group

        ray.kill(self.actor, no_restart=True)
        remove_placement_group(self.group)   # a no-op once another rank of the replica did

    kill = terminate

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"stage {self.stage} actor", timeout or 0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


def start_ranks(specs: list[WorkerSpec], stage: StageConfig) -> list[RayRank]:
    """One actor per rank of one replica, all in one placement group on one node; their
    rendezvous folder (on that node) new for each start."""
    require_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpu = specs[0].device.startswith("cuda")
    share = stage.gpu_share if len(specs) == 1 else multi_rank_share(stage)
    bundle = {"GPU": share} if gpu else {"CPU": 0.01}
    bundle.update(stage.placement.ray_resources)
    group = placement_group([bundle] * len(specs), strategy="STRICT_PACK")
    actor_class = _actor_class()
    run_dir = os.path.join(tempfile.gettempdir(),
                           f"omnistage-{specs[0].shm_namespace}-{secrets.token_hex(3)}")
    ranks = []
    for i, spec in enumerate(specs):
        spec = replace(spec, run_dir=run_dir)
        options = {"num_cpus": 0 if gpu else 0.01, "num_gpus": share if gpu else 0,
                   "resources": dict(stage.placement.ray_resources), "max_restarts": 0,
                   "runtime_env": {"env_vars": _stage_env()},
                   "scheduling_strategy": PlacementGroupSchedulingStrategy(group, i)}
        ranks.append(RayRank(actor_class.options(**options).remote(spec), spec.stage, group))
    return ranks


def multi_rank_share(stage: StageConfig) -> float:
    """The GPU share of each rank of a stage of several ranks. Each needs a GPU of its own,
    never two ranks on one: whole GPUs, or a stated `ray_gpus` above one half (two such
    bundles cannot meet on one GPU), which leaves the rest of each GPU to smaller stages,
    e.g. a talker beside a tensor-parallel thinker's rank."""
    if stage.placement.ray_gpus is not None and stage.placement.ray_gpus > 0.5:
        return stage.placement.ray_gpus
    return 1.0


def _stage_env() -> dict[str, str]:
    """The actor's environment: this omnistage first on its path (every node needs it at the
    same place, or installed), the model families registered out of tree, and Ray told not to
    SIGKILL the actor's children when it ends: the stage process then gets its SIGTERM from
    its parent's death and frees its segments (measured: with Ray's default, none was)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
           "RAY_kill_child_processes_on_worker_exit": "0"}
    if os.environ.get(FAMILY_MODULES_ENV):
        env[FAMILY_MODULES_ENV] = os.environ[FAMILY_MODULES_ENV]
    return env
