"""The stage interface's contract, driven through the front door with fake stages
(omnistage/testing/fake_stage.py) on the in-process backend, no model:

- routing: what a stage emits reaches the stage downstream along the edge, in order, and
  its input is closed once upstream finished;
- free vs abort: a finished request is freed in every stage (no abort call); one the caller
  drops is aborted in every stage it reached;
- error kinds: a refused input (invalid_input, naming the field), a failing step (internal),
  a stage whose thread ended (stage_dead), the engine shut down under a request (aborted):
  each reaches OmniOutput.error_info with the stage that caused it;
- progress: a stage's per-step progress reaches the caller that asks, and only that one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnistage.engine.async_omni import AsyncOmni
from omnistage.outputs import OmniOutput
from omnistage.sampling_params import SamplingParams
from omnistage.testing import fake_stage
from omnistage.testing.fake_stage import (BAD_INPUT, CRASH, DIE, DOWNSTREAM_SHIFT, LOGS, OK,
                                          SLOW, STEPS, contract_graph_yaml)
from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("contract_tok")
    build_tiny_tokenizer(path)
    return path


def engine(tokenizer_dir: Path, chain: bool) -> AsyncOmni:
    LOGS.clear()
    return AsyncOmni(stage_config=contract_graph_yaml(str(tokenizer_dir), chain=chain),
                     device="cpu")


@pytest.fixture
def chain(tokenizer_dir: Path) -> Iterator[AsyncOmni]:
    omni = engine(tokenizer_dir, chain=True)
    yield omni
    omni.shutdown()


@pytest.fixture
def solo(tokenizer_dir: Path) -> Iterator[AsyncOmni]:
    omni = engine(tokenizer_dir, chain=False)
    yield omni
    omni.shutdown()


def collect(omni: AsyncOmni, mode: int, rid: str, *, want_progress: bool = False,
            stop_after: int | None = None) -> list[OmniOutput]:
    """The request's snapshots; `stop_after`: the caller goes away after that many."""
    async def go() -> list[OmniOutput]:
        seen = []
        gen = omni.generate({"prompt_token_ids": [mode, 7, 8]}, SamplingParams(max_tokens=8),
                            request_id=rid, want_progress=want_progress)
        async for out in gen:
            seen.append(out)
            if stop_after is not None and len(seen) >= stop_after:
                break
        await gen.aclose()
        return seen

    return asyncio.run(asyncio.wait_for(go(), TIMEOUT_S))


def wait_for(check, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not check():
        assert time.monotonic() < deadline, f"not seen in {TIMEOUT_S} s: {what}"
        time.sleep(0.01)


def test_routing_along_the_edge(chain: AsyncOmni) -> None:
    outs = collect(chain, OK, "r1")
    last = outs[-1]
    assert last.finished and last.error_info is None
    emitted = [11, 12, 13, 14][:STEPS]
    assert last.token_ids == [t + DOWNSTREAM_SHIFT for t in emitted]
    fed = [tokens for kind, rid, tokens in LOGS["second"].calls if kind == "feed"]
    assert sum(fed, []) == emitted                   # every token, once, in order
    assert LOGS["second"].of("close") == ["r1"]      # upstream finished: input closed
    assert LOGS["first"].of("add") == ["r1"] and LOGS["second"].of("add") == ["r1"]


def test_a_finished_request_is_freed_not_aborted(chain: AsyncOmni) -> None:
    assert collect(chain, OK, "done")[-1].finished
    # FreeRequest drops the request in the worker without calling the engine's abort
    time.sleep(0.2)
    assert LOGS["first"].of("abort") == [] and LOGS["second"].of("abort") == []


def test_a_dropped_request_is_aborted_in_every_stage_it_reached(chain: AsyncOmni) -> None:
    outs = collect(chain, SLOW, "gone", stop_after=2)
    assert not outs[-1].finished and len(outs[-1].token_ids) >= 1
    wait_for(lambda: set(LOGS["first"].of("abort")) == {"gone"}
             and set(LOGS["second"].of("abort")) == {"gone"},
             f"abort in both stages ({ {k: v.calls[-3:] for k, v in LOGS.items()} })")
    assert collect(chain, OK, "after")[-1].error_info is None   # the stages serve on


# DIE ends the stage's thread with SystemExit, which pytest reports as a warning
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("mode, kind, param", [(BAD_INPUT, "invalid_input", "prompt"),
                                               (CRASH, "internal", None),
                                               (DIE, "stage_dead", None)])
def test_error_kinds_reach_the_output(solo: AsyncOmni, mode: int, kind: str,
                                      param: str | None) -> None:
    (out,) = [o for o in collect(solo, mode, f"err-{kind}") if o.finished]
    assert out.finish_reason == "error" and out.error
    info = out.error_info
    assert info is not None and (info.kind, info.stage, info.param) == (kind, "first", param)
    assert out.invalid_input == (kind == "invalid_input")
    if kind != "stage_dead":      # the stage serves on
        assert collect(solo, OK, f"after-{kind}")[-1].error_info is None
    else:
        assert not solo.is_healthy


def test_shutdown_aborts_the_requests_in_flight(tokenizer_dir: Path) -> None:
    omni = engine(tokenizer_dir, chain=False)
    seen: list[OmniOutput] = []

    async def go() -> None:
        async for out in omni.generate({"prompt_token_ids": [SLOW, 7]},
                                       SamplingParams(max_tokens=8), request_id="cut"):
            seen.append(out)
            if len(seen) == 1:
                omni.shutdown()

    asyncio.run(asyncio.wait_for(go(), TIMEOUT_S))
    last = seen[-1]
    assert last.finished and last.error_info is not None
    assert last.error_info.kind == "aborted"


@pytest.mark.parametrize("want_progress", [True, False])
def test_progress_only_to_the_caller_that_asks(solo: AsyncOmni, want_progress: bool) -> None:
    outs = collect(solo, OK, f"p-{want_progress}", want_progress=want_progress)
    progress = [o.progress for o in outs if not o.finished]
    if want_progress:
        assert progress == [k / STEPS for k in range(1, STEPS)]
    else:
        assert progress == []
    assert outs[-1].finished and outs[-1].token_ids == [11, 12, 13, 14][:STEPS]


def test_the_fake_is_what_the_contract_test_thinks() -> None:
    """The checks above are not vacuous: the fake refuses, fails and dies as documented."""
    from omnistage.configs.schema import StageConfig
    from omnistage.errors import InputError
    from omnistage.stages.interface import StageRequest

    stage = fake_stage.FakeStage(StageConfig(name="x", kind="ar", final="text"), "", "cpu")
    with pytest.raises(InputError):
        stage.add(StageRequest("a", 0.0, prompt_token_ids=[BAD_INPUT]))
    stage.add(StageRequest("b", 0.0, prompt_token_ids=[CRASH]))
    with pytest.raises(RuntimeError):
        stage.step()
    stage.abort("b")
    stage.add(StageRequest("c", 0.0, prompt_token_ids=[DIE]))
    with pytest.raises(SystemExit):
        stage.step()
    stage.abort("c")
    stage.add(StageRequest("d", 0.0, prompt_token_ids=[OK]))
    results = [r for _ in range(STEPS) for r in stage.step()]
    assert [r.progress for r in results] == [k / STEPS for k in range(1, STEPS + 1)]
    assert results[-1].finished and not stage.has_unfinished_requests
