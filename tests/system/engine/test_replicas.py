"""Replicas of a stage behind the orchestrator's router (issue 19, parts 2 and 3): the toy
pipeline's middle stage as two processes; the same outputs as one, requests spread over both,
and a replica killed under load fails only the requests it held."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from omnistage import Omni
from omnistage.configs.schema import ARSettings, Placement, StageConfig
from omnistage.outputs import RequestEvent
from omnistage.testing.processes import alive
from omnistage.testing.toy_pipeline import toy_graph_yaml

PROMPTS = [{"prompt_token_ids": list(range(5 + i, 25 + i))} for i in range(6)]


def _generate(model: Path, replicas: int) -> tuple[list, dict]:
    yaml_text = toy_graph_yaml(model, chunked=True, max_tokens=12, second_replicas=replicas)
    with Omni(stage_config=yaml_text, device="cpu") as omni:
        outs = omni.generate(PROMPTS)
        stats = omni.engine.orchestrator.stage_stats()
    return outs, stats


def test_two_replicas_give_the_same_outputs_and_share_the_requests(tiny_qwen3: Path) -> None:
    one, _ = _generate(tiny_qwen3, 1)
    two, stats = _generate(tiny_qwen3, 2)
    for out, ref in zip(two, one):
        assert out.error is None and out.finished
        assert out.token_ids == ref.token_ids
        assert torch.equal(out.tensors["vectors"], ref.tensors["vectors"])
    assert set(stats) == {"first", "second#0", "second#1", "vectors"}
    # six requests added at once, least outstanding first: three to each replica
    for key in ("second#0", "second#1"):
        assert stats[key].num_output_tokens == 3 * 12, (key, stats[key].num_output_tokens)
        assert stats[key].num_requests == 0


def _wait(predicate, timeout_s: float, what: object) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_killed_replica_fails_only_its_requests(tiny_qwen3: Path) -> None:
    yaml_text = toy_graph_yaml(tiny_qwen3, chunked=True, max_tokens=200, second_replicas=2)
    with Omni(stage_config=yaml_text, device="cpu") as omni:
        orch = omni.engine.orchestrator
        pids = [p for ps in orch.stages.rank_pids.values() for p in ps]
        namespace = orch.resources["shm_namespace"]
        events: dict[str, list[RequestEvent]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        for (rid, evs), prompt in zip(events.items(), PROMPTS):
            omni.engine.submit(prompt, None, rid, None, evs.append)
        placed = {rid: orch._routes[rid].replicas["second"] for rid in events}
        assert sorted(placed.values()) == [0, 0, 0, 1, 1, 1]
        # every request has output from the last stage: the victim replica holds work
        _wait(lambda: all(any(e.tensors for e in evs) for evs in events.values()), 10,
              "no output")
        os.kill(orch.stages.replica_pids["second"][1], signal.SIGKILL)
        _wait(lambda: all(evs and evs[-1].done for evs in events.values()), 20,
              {rid: evs[-1:] for rid, evs in events.items()})
        for rid, evs in events.items():
            last = evs[-1]
            if placed[rid] == 1:
                assert last.finish_reason == "error", (rid, last)
                assert "stage 'second' replica 1 died" in str(last.error), last.error
                assert last.error.kind == "stage_dead"
                assert last.error.stage == "second"
            else:
                assert last.error is None and last.finish_reason is not None, (rid, last)
                assert sum(len(e.tensors["vectors"]) for e in evs if e.tensors) == 200
        assert omni.is_healthy
        assert "stage 'second' replica 1 killed by signal 9" in orch.degraded_reason
        status = orch.replica_status()["second"]
        assert [s["live"] for s in status] == [True, False]
        later = omni.generate(PROMPTS[:2])          # routed to the live replica
        assert all(o.error is None and o.finished for o in later)
        assert all(orch.replica_status()["second"][r]["outstanding"] == 0 for r in (0, 1))
    _wait(lambda: not [p for p in pids if alive(p)], 5, "stage processes left")
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(namespace)]


def test_a_stage_with_no_live_replica_makes_the_engine_unhealthy(tiny_qwen3: Path) -> None:
    yaml_text = toy_graph_yaml(tiny_qwen3, chunked=True, max_tokens=12, second_replicas=2)
    with Omni(stage_config=yaml_text, device="cpu") as omni:
        orch = omni.engine.orchestrator
        victim = orch.stages.replica_pids["second"][0]
        os.kill(victim, signal.SIGKILL)
        _wait(lambda: orch.degraded_reason is not None, 5, "replica 0 not seen dead")
        (out,) = omni.generate(PROMPTS[:1])
        assert out.error is None and out.finished
        os.kill(orch.stages.replica_pids["second"][1], signal.SIGKILL)
        _wait(lambda: not omni.is_healthy, 5, "still healthy")
        assert "stage 'second' replica 1" in orch.dead_reason
        with pytest.raises(RuntimeError, match="unhealthy"):
            omni.generate(PROMPTS[0])


def test_a_dead_replica_is_restarted_and_serves_again(tiny_qwen3: Path) -> None:
    yaml_text = toy_graph_yaml(tiny_qwen3, chunked=True, max_tokens=12, second_replicas=2)
    yaml_text = yaml_text.replace("      replicas: 2\n", "      replicas: 2\n      max_restarts: 1\n")
    with Omni(stage_config=yaml_text, device="cpu") as omni:
        orch = omni.engine.orchestrator
        old = orch.stages.replica_pids["second"][1]
        os.kill(old, signal.SIGKILL)
        _wait(lambda: orch.degraded_reason is not None, 5, "replica 1 not seen dead")
        assert "(restarting)" in orch.degraded_reason
        _wait(lambda: orch.degraded_reason is None, 15, orch.degraded_reason)
        new = orch.stages.replica_pids["second"][1]
        assert new != old and alive(new) and not alive(old)
        outs = omni.generate(PROMPTS[:4])             # two of them on the restarted replica
        assert all(o.error is None and o.finished for o in outs)
        assert orch.stage_stats()["second#1"].num_output_tokens == 2 * 12
        os.kill(new, signal.SIGKILL)                  # its one restart is spent: stays down
        _wait(lambda: orch.degraded_reason is not None, 5, "replica 1 not seen dead")
        time.sleep(0.5)
        assert "(restarting)" not in orch.degraded_reason and omni.is_healthy


def test_replica_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="replicas"):
        Placement(replicas=0)
    with pytest.raises(ValueError, match="replica_devices"):
        Placement(replicas=2, replica_devices=[[0]])
    stage = StageConfig(name="s", kind="ar",
                        placement=Placement(replicas=2, replica_devices=[[0], [1]]))
    assert stage.devices_of(1) == (1,)
    assert Placement(devices=[2], replicas=2).devices_of(1) == (2,)
    with pytest.raises(ValueError, match="max_restarts"):
        Placement(max_restarts=-1)


def test_requests_a_dead_replica_had_not_started_go_to_another(tiny_qwen3: Path) -> None:
    """The first stage stopped, so nothing has reached the second stage's replicas yet: the
    requests of the one killed go to the other, over tcp (the producer told where)."""
    yaml_text = toy_graph_yaml(tiny_qwen3, chunked=True, max_tokens=12, second_replicas=2,
                               connector="tcp")
    with Omni(stage_config=yaml_text, device="cpu") as omni:
        orch = omni.engine.orchestrator
        first = orch.stages.pids["first"]
        os.kill(first, signal.SIGSTOP)
        try:
            events: dict[str, list[RequestEvent]] = {f"r{i}": [] for i in range(4)}
            for (rid, evs), prompt in zip(events.items(), PROMPTS):
                omni.engine.submit(prompt, None, rid, None, evs.append)
            os.kill(orch.stages.replica_pids["second"][1], signal.SIGKILL)
            _wait(lambda: orch.degraded_reason is not None, 5, "replica 1 not seen dead")
        finally:
            os.kill(first, signal.SIGCONT)
        _wait(lambda: all(evs and evs[-1].done for evs in events.values()), 20, events)
        assert all(evs[-1].error is None for evs in events.values()), events
        assert {orch._routes.get(r) for r in events} == {None}
        assert orch.replicas.num_rerouted == 2
        assert [o.token_ids for o in omni.generate(PROMPTS[:4])] == [
            sum((e.token_ids for e in evs if e.stage == "first"), []) for evs in events.values()]


def test_the_router_weighs_the_steps_requests_ask_for() -> None:
    """A replica holding one request of 1024 tokens has more work than one holding three of
    16: the next request goes to the second. Equal work: the fewest requests, then the lowest
    index. Diffusion counts steps times images; a generation stage, one per request."""
    from types import SimpleNamespace

    from omnistage.diffusion.params import DiffusionParams
    from omnistage.engine.replicas import ReplicaBook, request_work
    from omnistage.sampling_params import SamplingParams

    ar = StageConfig(name="talker", kind="ar", placement=Placement(replicas=2),
                     ar=ARSettings(sampling={"max_tokens": 300}))
    assert request_work(ar, SamplingParams(max_tokens=1024)) == 1024
    assert request_work(ar, None) == 300                       # the stage's default
    assert request_work(StageConfig(name="v", kind="generation"), None) == 1
    dit = StageConfig(name="dit", kind="diffusion", component="digits")
    assert request_work(dit, DiffusionParams(num_inference_steps=8, num_images=2)) == 16

    book = ReplicaBook.__new__(ReplicaBook)
    book.stages = SimpleNamespace(live=lambda name: [0, 1])
    assert book.pick({"talker"}, {"talker": [(1024, 1), (48, 3)]}) == {"talker": 1}
    assert book.pick({"talker"}, {"talker": [(64, 2), (64, 1)]}) == {"talker": 1}
    assert book.pick({"talker"}, {"talker": [(64, 1), (64, 1)]}) == {"talker": 0}
    book.stages = SimpleNamespace(live=lambda name: [0])     # the other one is down
    assert book.pick({"talker"}, {"talker": [(1024, 1), (48, 3)]}) == {"talker": 0}
