"""Starting stage workers: one process each (process backend) or one thread each (inproc
backend), with the same worker code behind the same kind of sockets.

A stage process is `python -m omnistage.stages.entry`, its start arguments (a `ProcessStart`,
launch.py) pickled down its stdin: not multiprocessing's spawn, whose child imports the user's
main script again (so every script needed an `if __name__ == "__main__":` guard, and
`python - < script` could not work at all). It is named `omnistage: stage NAME` in ps (entry.py).

Process lifecycle:
- ready handshake: a worker sends Ready (or StartupFailed with the reason) once its model is
  loaded; the orchestrator waits up to the stage's start-up timeout;
- parent death: PR_SET_PDEATHSIG (SIGTERM) plus a watchdog thread that polls the parent pid,
  so a stage exits within a second even when the parent is SIGKILLed, and frees what the
  parent can no longer free (shared-memory segments, the ipc socket folder);
- SIGTERM ends a worker cleanly (connector closed, segments freed); SIGINT is ignored, since
  Ctrl-C belongs to the parent, which then shuts the stages down.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from omnistage.configs.schema import GraphConfig, StageConfig
from omnistage.connectors.base import Connector, make_connector
from omnistage.errors import StageError
from omnistage.stages import messages as m
from omnistage.stages import ranks
from omnistage.stages.info import StageInfo
# WorkerSpec is re-exported: the engine's stage set imports it here with StageRunner
from omnistage.stages.launch import WorkerSpec, start_stage_process
from omnistage.stages.liveness import LivenessThread
from omnistage.utils import trace

if TYPE_CHECKING:
    from omnistage.stages.ray_actor import RayRank

logger = logging.getLogger(__name__)

WATCHDOG_PERIOD_S = 0.2
# Stages of one process (backend inproc) build their engines one at a time: a stage loading
# its first kernels (a module load syncs the device) while another captures its CUDA graphs
# invalidates the capture (seen on an H200: "operation failed due to a previous error during
# capture"). Requests come only when every stage is ready, so serving never waits on it.
_INPROC_BUILDS = threading.Lock()


def check_gpu_placement(graph: GraphConfig, device: str) -> None:
    """The stages' parallel layouts are possible (stages/ranks.py), every stage's GPU (each
    rank's) exists, and AR stages on one GPU, which each size their KV cache to
    `memory_fraction` of the whole device, leave room for each other (the fractions of the
    stages that share a GPU add up to at most 1), or the first to start takes the memory the
    others need. ValueError naming the stages. Under backend ray only the layouts: Ray
    places the stages on its nodes' GPUs (each rank takes its memory_fraction of one)."""
    ranks.check_parallel_layouts(graph, stage_device(device, (0,)))   # each replica's too
    if graph.backend == "ray":
        return
    shares: dict[str, list[tuple[str, float]]] = {}
    num_gpus: int | None = None
    for stage, replica, rank in _every_rank(graph):
        first = stage_device(device, stage.devices_of(replica))
        where = ranks.rank_device(first, stage, rank, replica)
        if where.startswith("cuda"):
            if num_gpus is None:
                import torch

                num_gpus = torch.cuda.device_count()
            _check_gpu_exists(stage.name, where, num_gpus)
        if stage.kind == "ar" and where.startswith("cuda"):
            name = stage.name if stage.placement.replicas == 1 else replica_name(stage.name, replica)
            shares.setdefault(where, []).append((name, stage.placement.memory_fraction))
    for where, stages in shares.items():
        total = sum(f for _, f in stages)
        if len(stages) > 1 and total > 1.0 + 1e-9:
            listed = ", ".join(f"{n} {f:g}" for n, f in stages)
            raise ValueError(f"stages {listed} share {where}: their memory_fraction add up to "
                             f"{total:g} of the device; lower them (each is a share of the "
                             "whole GPU) or put stages on other devices")


def _every_rank(graph: GraphConfig) -> list[tuple[StageConfig, int, int]]:
    """(stage, replica, rank) of every process the graph starts."""
    return [(s, replica, rank) for s in graph.stages for replica in range(s.placement.replicas)
            for rank in range(s.parallel.world_size)]


def replica_name(stage: str, replica: int) -> str:
    """How the stats and the GPU check name one replica of a replicated stage: `second#1`."""
    return f"{stage}#{replica}"


def _check_gpu_exists(stage: str, where: str, num_gpus: int) -> None:
    index = int(where.partition(":")[2] or 0)
    if index >= num_gpus:
        fix = ("run on the CPU (device cpu)" if num_gpus == 0 else
               "change the stage's devices (or pick a graph for fewer GPUs)")
        raise ValueError(f"stage {stage!r} is placed on {where}, but this machine has "
                         f"{num_gpus} GPU{'s' if num_gpus != 1 else ''}: {fix}")


def stage_device(device: str, devices: tuple[int, ...]) -> str:
    """The torch device of a stage: the graph's device kind on the stage's first device."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and ":" not in device:
        return f"cuda:{devices[0]}"
    return device


def stage_cpu_threads(graph: GraphConfig, device: str) -> int:
    """Intra-op CPU threads of a stage process. A GPU stage's host work is bookkeeping on a
    few rows (its prompt rows, token ids, a frame's codes), which gains nothing from threads;
    with torch's default of one per core, every stage process's OpenMP pool spins on all the
    cores, and a 1 ms copy in one waits tens of ms for the others' to yield (measured: the
    talker's prompt took 30 ms, not 1, while the thinker decoded). So 1; a CPU stage, whose
    compute is on the host, gets its share of the cores (each replica one share)."""
    if not device.startswith("cpu"):
        return 1
    return max(1, len(os.sched_getaffinity(0)) // sum(s.placement.replicas for s in graph.stages))


def make_stage_connector(spec: WorkerSpec) -> Connector:
    kind = spec.graph.connector_kind
    if kind == "shm":
        return make_connector("shm", namespace=spec.shm_namespace)
    if kind == "tcp":
        return make_connector("tcp", listen=f"tcp://{spec.tcp_host}:0")
    if kind == "auto":
        return make_connector("auto", namespace=spec.shm_namespace,
                              listen=f"tcp://{spec.tcp_host}:0", tag=spec.shm_tag or None)
    raise ValueError(f"connector {kind!r} cannot cross processes (use shm or tcp)")


def use_device(spec: WorkerSpec) -> None:
    """Make the stage's GPU this thread's current device (Triton launches, and torch.cuda calls
    without a device, go to the current device, not the tensors'), and its work this thread's
    stream at the stage's `placement.stream_priority` (the current stream is per thread)."""
    if not spec.device.startswith("cuda:"):
        return
    import torch

    stage = spec.graph.stage(spec.stage)
    torch.cuda.set_device(torch.device(spec.device))
    # cuDNN's attention builds a graph per new input shape: 60 to 960 ms each on an H100
    # (measured on code2wav's stream windows), where the flash and memory-efficient kernels
    # need none, and prompts and streams bring new shapes all the time. A diffusion stage
    # sees few shapes (a resolution and a prompt length), and there cuDNN's kernel is 1.7x
    # flash's (346 against 586 us a call, Qwen-Image at 1024 px, H200): it keeps cuDNN unless
    # told not to, in a process of its own (the switch is the process's)
    diffusion = stage.diffusion if stage.kind == "diffusion" else None
    torch.backends.cuda.enable_cudnn_sdp(diffusion is not None and diffusion.cudnn_attention
                                         and spec.graph.backend != "inproc")
    if stage.placement.stream_priority:
        torch.cuda.set_stream(torch.cuda.Stream(torch.device(spec.device),
                                                priority=stage.placement.stream_priority))


def run_worker(spec: WorkerSpec, ctx: zmq.Context, connector: Connector,
               own_process: bool = False) -> None:
    """Build the stage, say Ready (or why not), serve until Shutdown. Closes what it opened.
    `own_process`: the stage's process is its own (process backend), not the user's."""
    from omnistage.stages.worker import StageWorker

    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 1000)
    outbox.connect(spec.outbox)
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.connect(spec.inbox)
    try:
        try:
            use_device(spec)
            stage = spec.graph.stage(spec.stage)
            if stage.parallel.world_size > 1:
                ranks.join_stage_group(spec, stage)
            with contextlib.nullcontext() if own_process else _INPROC_BUILDS:
                worker = StageWorker(stage, spec.graph, connector, spec.device, spec.replica)
        except BaseException as exc:
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            logger.error("stage %s failed to start:\n%s", spec.stage, traceback.format_exc())
            outbox.send(m.encode(m.StartupFailed(
                spec.stage, StageError(spec.stage, "internal", detail), spec.replica)))
            return
        if own_process:
            # the model, its graphs and caches live as long as the stage: out of the
            # collector's sight, so that a full collection (seen: 200 ms in the talker's step
            # at concurrency 32) never walks them mid-stream
            gc.collect()
            gc.freeze()
        info = worker.engine.info()
        outbox.send(m.encode(m.Ready(spec.stage, os.getpid(),
                                     connector.address, info, spec.replica, spec.node)))
        worker.serve(inbox, outbox)
        if stage.parallel.world_size > 1:   # a clean shutdown (after a failure: ended by the
            worker.engine.stop_followers()  # orchestrator, as they may wait in a collective)
    finally:
        trace.save()
        connector.close()
        inbox.close()
        outbox.close()


def describe_stage(name: str, kind: str, info: StageInfo) -> str:
    """One line on what a started stage got (logged at start-up)."""
    if info.num_kv_blocks is None or info.kv_block_size is None:
        return f"stage {name} ({kind}) ready"
    tokens = info.num_kv_blocks * info.kv_block_size
    graphs = ",".join(map(str, info.cuda_graphs)) or "none"
    return (f"stage {name} ({kind}) on {info.device}, {info.dtype}: KV cache "
            f"{info.num_kv_blocks} blocks of {info.kv_block_size} = {tokens} tokens "
            f"({info.kv_cache_gib:g} GiB), max_model_len {info.max_model_len}, CUDA "
            f"graphs for decode batch sizes: {graphs}")


def _clean_after_parent(spec: WorkerSpec) -> None:
    """The parent is gone and cannot clean up: free what it would have freed. A Ray actor's
    stage (a tag of its own) whose serving process lives on frees only its own segments: its
    actor alone was ended, and the other stages on the node still use theirs."""
    from omnistage.connectors.shm import sweep

    driver_gone = spec.node == spec.driver_node and not _parent_alive(spec.driver_pid)
    if spec.shm_tag and not driver_gone:
        sweep(spec.shm_namespace, spec.shm_tag)
    else:
        sweep(spec.shm_namespace)
    shutil.rmtree(spec.run_dir, ignore_errors=True)


def _parent_alive(parent_pid: int) -> bool:
    """Whether the parent still runs (a zombie does not). Read from /proc rather than getppid:
    the death signal can arrive before the kernel has reparented us."""
    try:
        with open(f"/proc/{parent_pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back on the parent pid
        return os.getppid() == parent_pid


def _die_with_parent(spec: WorkerSpec, parent_pid: int) -> None:
    """SIGTERM on parent death (the handler exits cleanly), and a watchdog for the case where
    that signal cannot be delivered or handled in time."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_PERIOD_S)
        time.sleep(WATCHDOG_PERIOD_S * 5)  # give the SIGTERM path its chance first
        _clean_after_parent(spec)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def process_main(spec: WorkerSpec, parent_pid: int, log_level: int = logging.WARNING) -> None:
    """The stage process's body, after entry.py has read its ProcessStart: dies with its
    parent, serves until Shutdown or SIGTERM, never returns (os._exit)."""
    _die_with_parent(spec, parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_term(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: let the clean-up run
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    from omnistage.utils.logging import configure_logging

    configure_logging(log_level, fmt=f"%(asctime)s [stage {spec.stage}] %(levelname)s "
                                     "%(name)s: %(message)s")
    # tqdm's default lock is a multiprocessing semaphore, registered with the resource tracker;
    # this process ends in os._exit, so it would be reported as leaked at the parent's exit
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    import torch

    if "OMP_NUM_THREADS" not in os.environ:   # the user's setting wins
        torch.set_num_threads(stage_cpu_threads(spec.graph, spec.device))
    if spec.graph.stage(spec.stage).dtype == "float32":
        # asked for float32: mean it (PyTorch lets cuDNN convolutions use TF32 by default)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ctx = zmq.Context()
    # every rank, from now on: the orchestrator takes a process silent for its stage's
    # liveness_timeout_s for stopped (liveness.py)
    beat = LivenessThread(ctx, spec.outbox, spec.stage, spec.replica, spec.rank)
    code = 0
    try:
        if spec.rank == 0:
            run_worker(spec, ctx, make_stage_connector(spec), own_process=True)
        else:
            ranks.follow(spec, use_device)
    except SystemExit:
        pass
    except BaseException:   # a follower rank: nobody to report to but the log and its exit
        logger.exception("stage %s rank %d failed", spec.stage, spec.rank)
        code = 1
    finally:
        beat.stop()
        if not _parent_alive(parent_pid):
            _clean_after_parent(spec)
        ctx.destroy(linger=0)
        os._exit(code)


class StageRunner:
    """The orchestrator's hold on one running stage: its process (one per rank when the stage
    spans several devices), its Ray actors (one per rank, each holding that process;
    ray_actor.py), or its thread."""

    def __init__(self, spec: WorkerSpec, backend: str, ctx: zmq.Context,
                 shared_connector: Connector | None) -> None:
        self.spec = spec
        self.name = spec.stage
        self.processes: list[subprocess.Popen | RayRank] = []
        self.thread: threading.Thread | None = None
        self.hung: str | None = None      # why it was killed as hung (kill_hung), if it was
        stage = spec.graph.stage(spec.stage)
        if backend == "process":
            for rank_spec in ranks.rank_specs(spec, stage):
                self.processes.append(start_stage_process(rank_spec))
        elif backend == "ray":
            from omnistage.stages.ray_actor import start_ranks

            self.processes.extend(start_ranks(ranks.rank_specs(spec, stage), stage))
        else:
            conn = shared_connector if shared_connector is not None else make_stage_connector(spec)
            self.thread = threading.Thread(target=run_worker, args=(spec, ctx, conn),
                                           name=f"omnistage-{spec.stage}", daemon=True)
            self.thread.start()

    @property
    def pid(self) -> int:
        """Rank 0's process (the one the orchestrator speaks to)."""
        return self.processes[0].pid if self.processes else os.getpid()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes] or [os.getpid()]

    def is_alive(self) -> bool:
        """Every rank runs: a stage missing one cannot step."""
        if self.processes:
            return all(p.poll() is None for p in self.processes)
        return self.thread is not None and self.thread.is_alive()

    def rank_stopped(self, rank: int) -> bool | None:
        """Whether a rank's local process is stopped (SIGSTOP, traced) or gone, read from
        /proc; False: it runs (a C call holding the GIL can silence its beat thread for
        long: cuDNN, a blocking copy); None: not known here (a Ray actor's, no /proc)."""
        process = self.processes[rank] if rank < len(self.processes) else None
        if not isinstance(process, subprocess.Popen):
            return None
        try:
            stat = Path(f"/proc/{process.pid}/stat").read_text()
        except OSError:
            return None if not Path("/proc/self/stat").exists() else True
        return stat[stat.rindex(")") + 2] in "TtZX"

    def exit_description(self) -> str:
        """How the stage's process ended; of several ranks, each one that ended."""
        ended = []
        for rank, p in enumerate(self.processes):
            if p.poll() is not None:
                code = p.returncode
                how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
                how = getattr(p, "ended", None) or how      # a Ray actor's (RayRank) says more
                ended.append(how if len(self.processes) == 1 else
                             f"{how} (rank {rank} of {len(self.processes)})")
        how = "; ".join(ended) or "stopped"
        return how if self.hung is None else f"{self.hung}, then {how}"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Wait for a worker told to shut down; terminate, then kill, a process that lingers.
        Rank 0 goes first (it tells the other ranks to stop); every process is waited for
        (reaped), so none is left as a zombie."""
        for i, process in enumerate(self.processes):
            _end_process(process, timeout_s if i == 0 else 2.0)
        if self.thread is not None:
            self.thread.join(timeout_s)

    def kill_hung(self, why: str) -> None:
        """SIGKILL every rank of a stage found hung: a stopped process takes no SIGTERM, and
        a stuck one would not get to its handler."""
        self.hung = why
        for process in self.processes:
            if process.poll() is None:
                process.kill()

    def kill(self) -> None:
        """End every rank now (a rank died: the others would wait for it in a collective)."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            _end_process(process, 2.0)


def _end_process(process: subprocess.Popen, timeout_s: float) -> None:
    for end, wait_s in ((None, timeout_s), (process.terminate, 2.0), (process.kill, 2.0)):
        if process.poll() is not None:
            return
        if end is not None:
            end()
        try:
            process.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass
