"""Liveness apart from step progress (issue 37, item 3): a stage process that stops answering
(SIGSTOP, any rank of it) is killed within its `liveness_timeout_s`, with the default
`step_timeout_s` of 600 s, so its requests fail in seconds and /health says so; a step that
runs longer than `liveness_timeout_s` and then returns is not taken for a stopped process."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest

from omnistage import Omni, SamplingParams
from omnistage.stages.faults import FAULT_DIR_ENV, arm
from omnistage.testing.fault_matrix import Load, health, wait_for
from omnistage.testing.processes import alive
from omnistage.testing.toy_pipeline import toy_graph_yaml

LIVENESS_S = 2.0        # the tests' liveness_timeout_s (the default is 10 s)
MARGIN_S = 15.0         # the kill, the failure's way to the client, a busy shared CPU
LONG = [SamplingParams(max_tokens=2000, ignore_eos=True)]


def _engine(model: Path, tp: int = 1, max_restarts: int = 1) -> Omni:
    """The text graph on the CPU with a short liveness timeout and the default step timeout."""
    omni = Omni(str(model), device="cpu", tensor_parallel_size=tp,
                stage_overrides=[f"llm.timeouts.liveness_s={LIVENESS_S:g}",
                                 f"llm.placement.max_restarts={max_restarts}"])
    assert omni.engine.graph.stage("llm").timeouts.step_s == 600.0
    (out,) = omni.generate(["hi"], [SamplingParams(max_tokens=2)], use_tqdm=False)
    assert out.error is None, out.error
    return omni


@pytest.fixture(scope="module")
def text_engine(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[Omni, Path]]:
    fault_dir = tmp_path_factory.mktemp("liveness-faults")
    with pytest.MonkeyPatch.context() as mp:    # the stage processes read it at start
        mp.setenv(FAULT_DIR_ENV, str(fault_dir))
        omni = _engine(tiny_qwen3)
    with omni:
        yield omni, fault_dir


def test_a_slow_step_is_not_taken_for_a_stopped_process(text_engine: tuple[Omni, Path]
                                                        ) -> None:
    omni, fault_dir = text_engine
    pid = omni.engine.orchestrator.stages.pids["llm"]
    armed = arm(fault_dir, "llm", "hang", seconds=2 * LIVENESS_S)   # sleeps, then returns
    load = Load(omni, ["a slow one"] * 2, [SamplingParams(max_tokens=8, ignore_eos=True)])
    outcome = load.settle(time.monotonic(), timeout_s=2 * LIVENESS_S + MARGIN_S)
    assert not armed.exists()                          # the slow step ran
    assert set(outcome.ended.values()) == {"ok"}, outcome
    assert health(omni) == "ok" and omni.engine.orchestrator.stages.pids["llm"] == pid
    loop = omni.engine.orchestrator.stage_stats()["llm"].loop
    assert loop["max_step_seconds"] > LIVENESS_S, loop     # longer than the liveness timeout


def _stop_and_settle(omni: Omni, rank: int) -> tuple[int, object]:
    """SIGSTOP one rank of the stage under load; -> its pid and how the requests ended (each
    within LIVENESS_S + MARGIN_S of the stop, or TimeoutError)."""
    load = Load(omni, ["count with me"] * 3, LONG)
    load.wait_started()
    pid = omni.engine.orchestrator.stages.rank_pids["llm"][rank]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        return pid, load.settle(t0, timeout_s=LIVENESS_S + MARGIN_S)
    finally:
        if alive(pid):    # not killed (the failure this tests for): let the teardown end it
            os.kill(pid, signal.SIGCONT)


def _ended(pid: int) -> None:
    """The stopped process was ended (SIGKILL reaches a stopped one), not left stopped."""
    wait_for(lambda: not alive(pid), 10, "the stopped process was not ended")


def _back(omni: Omni, stopped_pid: int) -> None:
    """The stopped process ended and the stage restarted: it serves again."""
    _ended(stopped_pid)
    wait_for(lambda: health(omni) == "ok", 60, "the stage did not come back")
    (out,) = omni.generate(["hi"], [SamplingParams(max_tokens=2)], use_tqdm=False)
    assert out.error is None, out.error


def test_a_stopped_stage_process_fails_its_requests_within_the_liveness_timeout(
        text_engine: tuple[Omni, Path]) -> None:
    omni, _ = text_engine
    pid, outcome = _stop_and_settle(omni, rank=0)
    assert set(outcome.ended.values()) == {"stage_dead"}, outcome
    assert outcome.health_at_failure == "503", outcome
    assert all("liveness" in e for e in outcome.errors.values()), outcome.errors
    _back(omni, pid)


def test_a_stopped_follower_rank_ends_its_stage(tiny_qwen3: Path) -> None:
    """A follower rank never speaks to the orchestrator, but it beats too: stopped, rank 0
    waits in a collective for it (no step ends), and liveness ends the whole stage, every
    rank. (Its restart is the fault matrix's text_tp2 rows'.)"""
    with _engine(tiny_qwen3, tp=2, max_restarts=0) as omni:
        pids = omni.engine.orchestrator.stages.rank_pids["llm"]
        pid, outcome = _stop_and_settle(omni, rank=1)
        assert set(outcome.ended.values()) == {"stage_dead"}, outcome
        assert outcome.health_at_failure == "503", outcome
        assert all("rank 1" in e and "liveness" in e for e in outcome.errors.values()), \
            outcome.errors
        for p in pids:
            _ended(p)


def test_a_stopped_replica_fails_only_its_requests_and_the_engine_serves_degraded(
        tiny_qwen3: Path) -> None:
    """Two replicas of the toy pipeline's middle stage, one stopped under load: as a killed
    one, only the requests it had started fail (the others complete), /health says
    "degraded" (another replica serves), and new requests go to the live one."""
    yaml_text = toy_graph_yaml(tiny_qwen3, chunked=True, max_tokens=120, second_replicas=2)
    yaml_text = yaml_text.replace("      replicas: 2\n", "      replicas: 2\n"
                                  f"    timeouts: {{liveness_s: {LIVENESS_S:g}}}\n")
    prompts = [{"prompt_token_ids": list(range(7 + i, 23 + i))} for i in range(4)]
    with Omni(stage_config=yaml_text, device="cpu") as omni:
        orch = omni.engine.orchestrator
        load = Load(omni, prompts, None)
        placed = {rid: orch._routes[rid].replicas["second"] for rid in load.events}
        assert sorted(placed.values()) == [0, 0, 1, 1]
        wait_for(lambda: all(any(e.tensors for e in evs) for evs in load.events.values()), 30,
                 "no output from the last stage")
        victim = orch.stages.replica_pids["second"][1]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        try:
            outcome = load.settle(t0, timeout_s=LIVENESS_S + MARGIN_S)
        finally:
            if alive(victim):
                os.kill(victim, signal.SIGCONT)
        assert outcome.ended == {rid: "stage_dead" if placed[rid] == 1 else "ok"
                                 for rid in placed}, outcome
        assert outcome.health_at_failure == "degraded", outcome
        assert "replica 1 stopped answering" in orch.degraded_reason, orch.degraded_reason
        _ended(victim)
        outs = omni.generate(prompts[:2], use_tqdm=False)     # on the live replica
        assert all(o.error is None and o.finished for o in outs)


def test_proc_tells_a_stopped_process_from_a_busy_one() -> None:
    """StageRunner.rank_stopped reads the process state: running (or sleeping) -> False,
    SIGSTOP -> True, ended -> True."""
    import subprocess
    import sys

    from omnistage.stages.process import StageRunner

    runner = StageRunner.__new__(StageRunner)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    runner.processes = [proc]
    try:
        assert runner.rank_stopped(0) is False
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not runner.rank_stopped(0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runner.rank_stopped(0) is True
    finally:
        proc.kill()
        proc.wait(10)
    assert runner.rank_stopped(0) is True
