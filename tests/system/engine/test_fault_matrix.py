"""The fault-injection matrix (issue 25): each graph's engine, serving a few long requests at
once, has one stage broken at a time (omnistage/testing/fault_matrix.py); what happens next is
the table EXPECT below, asserted: how the requests end (never a wait past its deadline), what
/health says when the first one fails, that the engine is back (the stage restarted) and
serves a new request, and that no process or /dev/shm segment is left after shutdown.

CI runs CI_CASES (every fault kind and every graph at least once, one engine per graph shared
across its faults); OMNISTAGE_FAULT_MATRIX=full runs every (graph, stage, fault), and
OMNISTAGE_FAULT_RESULTS=path.json records each outcome for scripts/reliability_doc.py.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import pytest

from omnistage import DiffusionParams, Omni, SamplingParams
from omnistage.testing.fault_matrix import (FAULTS, SLOW_STEP_S, Load, health, inject,
                                             leftovers, wait_for)
from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

LIVENESS_TIMEOUT_S = 2.0  # a process that sends no liveness beat this long is stopped (10 s)
STEP_TIMEOUT_S = 6.0     # a loop that sends no heartbeat this long is stuck in a step (600 s)
assert LIVENESS_TIMEOUT_S < SLOW_STEP_S < STEP_TIMEOUT_S
NUM_REQUESTS = 3
CHAT = [{"role": "user", "content": "hello"}]


@dataclass(frozen=True)
class Expect:
    ends: frozenset[str]        # how each request the stage held may end: "ok" or error kinds
    health: frozenset[str | None]   # /health when the first request failed (None: none did)
    recovers: bool = True       # back to "ok" and serving a new request
    says: str = ""              # what every request's error says (how the stage was found)


DEAD = Expect(frozenset({"stage_dead"}), frozenset({"503"}))   # restarted (max_restarts)
# fault -> outcome, for every stage of every graph; an exception per (graph, stage, fault) in
# EXCEPTIONS. A segment removal fails only a request whose chunk was in a segment at that
# moment (small chunks travel inline), and leaves the stage healthy.
EXPECT: dict[str, Expect] = {
    "sigkill": DEAD,
    "sigterm": DEAD,            # a clean exit of the stage is still its death
    # killed once its liveness beats stop (LIVENESS_TIMEOUT_S), then restarted
    "sigstop": Expect(DEAD.ends, DEAD.health, says="no liveness beat"),
    # a step past STEP_TIMEOUT_S: the process beats on, its loop is silent
    "hang": Expect(DEAD.ends, DEAD.health, says="no heartbeat"),
    "oom": Expect(frozenset({"internal"}), frozenset({"ok"})),   # the step's requests fail
    "segment": Expect(frozenset({"ok", "internal"}), frozenset({None, "ok"})),
    # a step longer than LIVENESS_TIMEOUT_S that returns: nothing is killed
    "slow": Expect(frozenset({"ok"}), frozenset({None})),
}
EXCEPTIONS: dict[tuple[str, str, str], Expect] = {
    # one AR stage with text out: no tensor crosses a process, so no segment exists
    ("text", "llm", "segment"): Expect(frozenset({"ok"}), frozenset({None})),
}
STAGES = {"text": ("llm",), "image": ("dit",), "omni": ("thinker", "talker", "code2wav"),
          "text_tp2": ("llm",)}
# graph -> the rank its faults hit: text_tp2 is the text graph over 2 gloo ranks, and rank 1
# (a follower: it runs no worker loop, so only the signals apply) is the one struck
RANK = {"text_tp2": 1}
RANK_FAULTS = ("sigkill", "sigterm", "sigstop")
CI_CASES = [("text", "llm", "oom"), ("text", "llm", "sigstop"), ("text", "llm", "slow"),
            ("image", "dit", "sigterm"), ("image", "dit", "hang"), ("image", "dit", "segment"),
            ("omni", "talker", "sigkill"), ("omni", "code2wav", "oom")]
FULL = os.environ.get("OMNISTAGE_FAULT_MATRIX") == "full"
CASES = ([(g, s, f) for g, stages in STAGES.items() for s in stages
          for f in (RANK_FAULTS if RANK.get(g) else FAULTS)] if FULL else CI_CASES)


def expected(graph: str, stage: str, fault: str) -> Expect:
    return EXCEPTIONS.get((graph, stage, fault), EXPECT[fault])


def _load(graph: str, fault: str) -> tuple[list, list]:
    """Long requests (prompts, per-stage params), so that each is in flight at the fault;
    shorter for a segment removal or a slow step, which they outlive and run to their
    end."""
    steps = 50 if fault in ("segment", "slow") else 200
    if graph.startswith("text"):
        return ["count with me"] * NUM_REQUESTS, [SamplingParams(max_tokens=2 * steps,
                                                                 ignore_eos=True)]
    if graph == "image":
        return ([f"a {i}" for i in range(NUM_REQUESTS)],
                [DiffusionParams(num_inference_steps=steps)])
    talk = SamplingParams(max_tokens=200, ignore_eos=True)
    return [{"messages": CHAT}] * NUM_REQUESTS, [talk, talk, None]


def _quick(graph: str) -> tuple[object, list]:
    """One short request: the engine serves again."""
    if graph.startswith("text"):
        return "hi", [SamplingParams(max_tokens=4)]
    if graph == "image":
        return "a 3", [DiffusionParams(num_inference_steps=2)]
    short = SamplingParams(max_tokens=4, ignore_eos=True)
    return {"messages": CHAT}, [short, short, None]


class Engine:
    """One graph's engine for all its faults, every process it ever ran noted for the end."""

    def __init__(self, graph: str, model: str | None, fault_dir: Path) -> None:
        overrides = [f"{s}.{k}" for s in STAGES[graph]
                     for k in ("placement.max_restarts=100", f"timeouts.step_s={STEP_TIMEOUT_S:g}",
                               f"timeouts.liveness_s={LIVENESS_TIMEOUT_S:g}")]
        self.graph, self.fault_dir = graph, fault_dir
        self.omni = Omni(model, device="cpu", stage_overrides=overrides,
                         tensor_parallel_size=2 if graph == "text_tp2" else 1)
        prompt, params = _quick(graph)    # first steps (lazy set-up) are not a fault's
        assert self.omni.generate([prompt], params, use_tqdm=False)[0].error is None
        self.namespace = self.omni.engine.orchestrator.resources["shm_namespace"]
        self.pids: set[int] = set()
        self.note_pids()

    def note_pids(self) -> None:
        for pids in self.omni.engine.orchestrator.stages.rank_pids.values():
            self.pids.update(pids)

    def close(self) -> tuple[list[int], list[str]]:
        self.note_pids()
        self.omni.engine.shutdown()
        return leftovers(sorted(self.pids), self.namespace)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3: Path) -> Iterator[dict]:
    """The graphs' engines, started when a case first needs one, with the fault hook on
    (OMNISTAGE_FAULT_DIR in the stages' environment); each shut down and checked for
    leftovers at the end."""
    fault_dir = tmp_path_factory.mktemp("faults")
    started: dict[str, Engine] = {}
    models = {"text": lambda: str(tiny_qwen3), "text_tp2": lambda: str(tiny_qwen3),
              "image": lambda: None,
              "omni": lambda: str(build_tiny_qwen3_omni(tmp_path_factory.mktemp("omni")))}

    def get(graph: str) -> Engine:
        if graph not in started:
            started[graph] = Engine(graph, models[graph](), fault_dir)
        return started[graph]

    with pytest.MonkeyPatch.context() as mp:   # for the restarted stages too
        mp.setenv("OMNISTAGE_FAULT_DIR", str(fault_dir))
        yield {"get": get}
        left = {graph: engine.close() for graph, engine in started.items()}
    _record({"shutdown": {g: {"processes": len(p), "segments": len(s)}
                          for g, (p, s) in left.items()}})
    assert all(not p and not s for p, s in left.values()), left


def _record(entry: dict) -> None:
    """Append one outcome to the results file, when one is asked for."""
    path = os.environ.get("OMNISTAGE_FAULT_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


@pytest.mark.parametrize(("graph", "stage", "fault"), CASES,
                         ids=["-".join(c) for c in CASES])
def test_fault(engines: dict, graph: str, stage: str, fault: str) -> None:
    engine: Engine = engines["get"](graph)
    omni, expect = engine.omni, expected(graph, stage, fault)
    wait_for(lambda: health(omni) == "ok", 60, "the engine is not healthy before the fault")
    pids = dict(omni.engine.orchestrator.stages.rank_pids)
    load = Load(omni, *_load(graph, fault))
    load.wait_started()
    t0 = time.monotonic()
    inject(omni, stage, fault, engine.fault_dir, rank=RANK.get(graph, 0))
    outcome = load.settle(t0, timeout_s=STEP_TIMEOUT_S + 60)
    engine.note_pids()
    t1 = time.monotonic()
    wait_for(lambda: health(omni) == "ok", 60, "the engine did not come back")
    prompt, params = _quick(graph)
    (after,) = omni.generate([prompt], params, use_tqdm=False)
    _record({"graph": graph, "stage": stage, "rank": RANK.get(graph, 0),
             "ranks": len(omni.engine.orchestrator.stages.rank_pids[stage]), "fault": fault,
             "ends": sorted(set(
        outcome.ended.values())), "health": outcome.health_at_failure,
             "recovered": after.error is None, "seconds_to_end": round(outcome.seconds, 2),
             "seconds_to_recover": round(time.monotonic() - t1, 2),
             "expected": {k: sorted(map(str, v)) if isinstance(v, frozenset) else v
                          for k, v in asdict(expect).items()}})
    assert set(outcome.ended.values()) <= expect.ends, outcome
    if expect.ends == DEAD.ends:
        assert all(f"stage {stage!r}" in e and expect.says in e
                   for e in outcome.errors.values()), outcome.errors
    if "stage_dead" not in expect.ends:    # nothing was killed
        assert omni.engine.orchestrator.stages.rank_pids == pids
    assert outcome.health_at_failure in expect.health, outcome
    assert (after.error is None) == expect.recovers, after.error
