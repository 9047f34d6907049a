"""What a stage process is, and starting one: `WorkerSpec` (a stage rank's place: its graph,
sockets, device, rank, replica), `ProcessStart` (the spec and what the child needs of its
parent, pickled down its stdin) and `start_stage_process`.

process.py (the stage process's body, and `StageRunner`, which starts a stage's ranks as
processes or Ray actors), ranks.py and ray_actor.py all build on this module, which imports
none of them: no import circle between the ways a stage starts.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path

from omnistage.configs.schema import GraphConfig


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    stage: str
    graph: GraphConfig
    inbox: str               # zmq address the worker PULLs from (the orchestrator binds it)
    outbox: str              # zmq address the worker PUSHes to (the orchestrator binds it)
    device: str              # "cpu" or "cuda:N"
    shm_namespace: str
    run_dir: str             # the orchestrator's folder of ipc sockets
    tcp_host: str = "127.0.0.1"
    rank: int = 0            # of a stage over several devices (stages/ranks.py); 0 speaks
    replica: int = 0         # which whole copy of the stage (StageConfig.placement.replicas)
    # backend ray (stages/ray_actor.py): the node this rank runs on, the serving process's
    # node and pid, and the tag of this stage's shm segments (so that a stage whose actor
    # died frees its own segments, not its neighbours')
    node: str = ""
    driver_node: str = ""
    driver_pid: int = 0
    shm_tag: str = ""


@dataclass(frozen=True, slots=True)
class ProcessStart:
    """What a stage process is started with (pickled down its stdin)."""
    spec: WorkerSpec
    parent_pid: int
    sys_path: tuple[str, ...]     # the parent's, so that the stage imports what it imports
    tracker_fd: int               # the parent's resource tracker (see start_stage_process)
    log_level: int = logging.WARNING   # the parent's: a server at INFO hears the stages' lines


def start_stage_process(spec: WorkerSpec, new_session: bool = False) -> subprocess.Popen:
    """Start `python -m omnistage.stages.entry` for one stage. The child imports this very
    omnistage (the folder above the package goes first on its PYTHONPATH; -P keeps the current
    folder off its path) and shares the parent's resource tracker, as multiprocessing's spawn
    children do, instead of starting one of its own (shm.py registers each segment with it
    for a moment). `new_session`: out of the parent's process group, so that a signal to the
    whole group (Ray ending an actor's worker) reaches the stage only as its parent's death,
    which it answers by cleaning up."""
    resource_tracker.ensure_running()
    tracker_fd = resource_tracker.getfd()
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-P", "-m", "omnistage.stages.entry"],
                            stdin=subprocess.PIPE, env=env, pass_fds=(tracker_fd,),
                            start_new_session=new_session)
    start = ProcessStart(spec, os.getpid(), tuple(sys.path), tracker_fd,
                         logging.getLogger().getEffectiveLevel())
    assert proc.stdin is not None
    try:
        proc.stdin.write(pickle.dumps(start))
        proc.stdin.close()
    except BrokenPipeError:   # died at import: StageSet reports its exit, its stderr says why
        pass
    return proc
