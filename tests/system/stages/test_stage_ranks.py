"""A stage over several ranks (issue 18), through the stage processes: layouts the checkpoint
cannot split are refused before any process starts; a tensor-parallel stage serves as one rank
does; a rank that dies fails its stage and leaves no process and no shared memory."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from omnistage import Omni, SamplingParams
from omnistage.configs.schema import ParallelSizes, StageConfig
from omnistage.stages.ranks import check_heads_divide
from omnistage.testing.processes import alive


@pytest.mark.parametrize("tp, message", [
    (3, r"stage 'llm': its 2 key/value heads neither split evenly over nor replicate evenly "
        r"on tensor_parallel_size 3"),
    (8, r"stage 'llm': its 4 attention heads do not divide by tensor_parallel_size = 8"),
])
def test_heads_that_do_not_divide_are_refused(tiny_qwen3: Path, tp: int, message: str) -> None:
    stage = StageConfig(name="llm", kind="ar", final="text", parallel=ParallelSizes(tp=tp))
    with pytest.raises(ValueError, match=message):
        check_heads_divide(stage, str(tiny_qwen3))
    # before anything starts: Omni refuses it without a stage process
    with pytest.raises(ValueError, match=message):
        Omni(str(tiny_qwen3), device="cpu", tensor_parallel_size=tp)


def test_heads_that_divide_or_replicate_pass(tiny_qwen3: Path) -> None:
    for tp in (2, 4):      # 4 query heads, 2 key/value heads: split at 2, replicated at 4
        check_heads_divide(StageConfig(name="llm", kind="ar", final="text",
                                       parallel=ParallelSizes(tp=tp)), str(tiny_qwen3))


def test_a_tensor_parallel_stage_serves_as_one_rank_does(tiny_qwen3: Path) -> None:
    """The llm stage over 2 processes (gloo): rank 0 serves, rank 1 follows its plans; the same
    greedy tokens as one process, for prompts of several lengths batched together."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    tokens = {}
    for tp in (1, 2):
        with Omni(str(tiny_qwen3), device="cpu", tensor_parallel_size=tp) as omni:
            pids = omni.engine.orchestrator.stages.rank_pids["llm"]
            assert len(pids) == tp and all(alive(p) for p in pids)
            tokens[tp] = [o.token_ids for o in omni.generate(prompts, params, use_tqdm=False)]
        assert not [p for p in pids if alive(p)]
    assert tokens[2] == tokens[1] and len(set(map(tuple, tokens[1]))) == 3


def test_a_killed_rank_fails_its_stage_and_leaves_nothing(tiny_qwen3: Path) -> None:
    """Rank 1 SIGKILLed mid-request: the request fails as its stage's death (naming the rank),
    the engine turns unhealthy, rank 0 is ended too, and no process or segment is left."""
    omni = Omni(str(tiny_qwen3), device="cpu", tensor_parallel_size=2, connector="shm")
    try:
        orch = omni.engine.orchestrator
        pids, namespace = orch.stages.rank_pids["llm"], orch.resources["shm_namespace"]
        events: list = []
        omni.engine.submit({"prompt_token_ids": list(range(5, 30))},
                           SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
                           "victim", None, events.append)
        _wait(lambda: events, "no output")
        os.kill(pids[1], signal.SIGKILL)
        _wait(lambda: events and events[-1].done, "the request did not end")
        info = events[-1].error
        assert info.kind == "stage_dead" and info.stage == "llm"
        assert "rank 1 of 2" in str(events[-1].error) and "killed by signal 9" in str(events[-1].error)
        assert not omni.is_healthy
        _wait(lambda: not alive(pids[0]), "rank 0 was not ended")
    finally:
        omni.shutdown()
    assert not [p for p in pids if alive(p)]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(namespace)]


def _wait(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
