"""The orchestrator's book of a graph's replicas: which are down and why, how often each was
restarted, which one a new request gets at each stage (the live one with the least outstanding
work: the steps its requests asked for, then their number), where a request goes when its
replica dies before it started there, what /health and /metrics say of them, and their answers
to GetStats."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from omnistage.configs.schema import GraphConfig, StageConfig
from omnistage.diffusion_params import DiffusionParams
from omnistage.sampling_params import SamplingParams
from omnistage.engine.stage_set import StageSet
from omnistage.stages import messages as m
from omnistage.stages.process import replica_name

logger = logging.getLogger(__name__)

# A replica's load at a stage: (the steps its outstanding requests asked for, their number)
Load = dict[str, list[tuple[int, int]]]


def request_work(stage: StageConfig, p: SamplingParams | DiffusionParams | None) -> int:
    """What one request asks of a stage, in its engine's steps, for the router to weigh: an AR
    stage's decode steps (the request's max_tokens, else the stage's default; unbounded counts
    as the model's 4096), a diffusion stage's denoising steps times images, one for a
    generation stage (its chunks follow its upstream's steps). Two requests of 16 and 1024
    tokens are not the same load on a talker replica."""
    if isinstance(p, DiffusionParams):
        return p.num_inference_steps * p.num_images
    if stage.kind != "ar":
        return 1
    p = p if isinstance(p, SamplingParams) else stage.default_sampling()
    return p.max_tokens or 4096


class ReplicaBook:
    def __init__(self, graph: GraphConfig, stages: StageSet) -> None:
        self.graph = graph
        self.stages = stages
        self.down: dict[tuple[str, int], str] = {}     # dead replicas -> how they ended
        self.restarts: dict[tuple[str, int], int] = {}
        self.num_rerouted = 0     # requests moved off a dead replica before they started there
        self._stats: dict[str, m.StageStats] = {}
        self._stats_ready = threading.Event()

    def who(self, name: str, replica: int) -> str:
        """How errors and logs name a replica (a stage of one: by the stage alone)."""
        return f"stage {name!r}" + (f" replica {replica}"
                                    if self.graph.stage(name).placement.replicas > 1 else "")

    def pick(self, needed: set[str], load: Load) -> dict[str, int]:
        """Each needed stage's replica for a new request: the live one with the least
        outstanding work (`request_work` summed), then the fewest requests, then the lowest
        index."""
        picked = {}
        for name in needed:
            live = self.stages.live(name)
            if not live:
                raise RuntimeError(f"engine is unhealthy: stage {name!r} has no live replica")
            picked[name] = min(live, key=lambda r: load[name][r])
        return picked

    def died(self, name: str, replica: int, how: str) -> None:
        """Mark a replica down; start it again if its stage allows another restart."""
        num_restarts = self.restarts.get((name, replica), 0)
        if num_restarts < self.graph.stage(name).placement.max_restarts:
            self.restarts[(name, replica)] = num_restarts + 1
            logger.warning("orchestrator: restarting %s (restart %d)", self.who(name, replica),
                           num_restarts + 1)
            self.stages.restart(name, replica)
        self.down[(name, replica)] = how

    def reroute(self, request_id: str, replicas: dict[str, int], add: m.AddRequest | None,
                name: str, load: Load,
                send: Callable[[str, int, m.ToStage], None]) -> bool:
        """A request whose replica of stage `name` died before it started there (its
        AddRequest still held: nothing came out of it, no chunk went to it; no client tensor
        was put for it) goes to the live replica with the least load: `replicas` updated, the
        AddRequest sent there, and its upstream stages told where its chunks now go (Reroute).
        False where it cannot go."""
        if add is None or add.inputs is not None or not self.stages.live(name):
            return False
        replicas[name] = self.pick({name}, load)[name]
        self.num_rerouted += 1
        send(name, replicas[name], add)
        for source in replicas:
            if any(i.source == source for i in self.graph.stage(name).inputs):
                send(source, replicas[source], m.Reroute(request_id, name, replicas[name]))
        return True

    def lost_chunk(self, replicas: dict[str, int], dest: str,
                   handle: m.TensorHandle | None) -> str | None:
        """Why a chunk for `dest` cannot reach the request's replica there: it went by tcp to
        the replica the request had before a re-route (pushed before the producer heard), so
        the new one would wait for it in vain. None for any other chunk."""
        if handle is None or handle.kind != "tcp":
            return None
        sent_to = m.key_replica(handle.key.edge)
        if sent_to is None or sent_to == replicas[dest]:
            return None
        return f"a chunk for {self.who(dest, sent_to)} was lost when it died"

    def back(self, stage: str, replica: int) -> None:
        self.down.pop((stage, replica), None)
        logger.warning("orchestrator: %s is back", self.who(stage, replica))

    def status(self, load: Load) -> dict[str, list[dict[str, int | bool]]]:
        """Each stage's replicas: whether it lives, its outstanding requests and their work."""
        return {name: [{"replica": r, "live": (name, r) not in self.down, "outstanding": n,
                        "outstanding_steps": work}
                       for r, (work, n) in enumerate(loads)]
                for name, loads in load.items()}

    def degraded_reason(self) -> str | None:
        """Which replicas are down (and restarting), or None."""
        if not self.down:
            return None
        return "; ".join(f"stage {n!r} replica {r} {how}"
                         + (" (restarting)" if (n, r) in self.stages.starting else "")
                         for (n, r), how in sorted(self.down.items()))

    # -- stats -----------------------------------------------------------------------------------
    def stats_key(self, stage: str, replica: int) -> str:
        return replica_name(stage, replica) if self.graph.stage(stage).placement.replicas > 1 else stage

    def ask_stats(self, send: Callable[[str, int, m.ToStage], None]) -> set[str]:
        """Send GetStats to every live replica; -> the keys the answers will come under."""
        self._stats = {}
        asked = set()
        for name in self.stages.runners:
            for r in self.stages.live(name):
                asked.add(self.stats_key(name, r))
                send(name, r, m.GetStats())
        return asked

    def got_stats(self, msg: m.StageStats) -> None:
        """An answer, as the router receives it."""
        self._stats[self.stats_key(msg.stage, msg.replica)] = msg
        self._stats_ready.set()

    def wait_stats(self, asked: set[str], timeout_s: float) -> dict[str, m.StageStats]:
        deadline = time.monotonic() + timeout_s
        while not asked <= set(self._stats):
            self._stats_ready.wait(0.05)
            self._stats_ready.clear()
            if time.monotonic() > deadline:
                raise TimeoutError(f"stage stats: no answer from "
                                   f"{sorted(asked - set(self._stats))}")
        return {k: v for k, v in self._stats.items() if k in asked}
