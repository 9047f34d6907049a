"""backend: ray (issue 19): the toy pipeline's stages as Ray actors on a two-node cluster made on
this machine (ray.cluster_utils.Cluster; a custom resource per node, so that a stage's
`ray_resources` pins it to one). One cluster for the module: Ray is slow to start.

    node_a: the driver (this process), `first`, `vectors`     node_b: `second` x 2 replicas
    (`first` as two tensor-parallel ranks: two actors in one placement group, in one test)
    first -> second and second -> vectors cross nodes (tcp), vectors -> client does not (shm)

Outputs equal the process backend's; `ray.kill` of a replica under load fails only its
requests, and it restarts; a stalled upstream fails a request at its deadline; a SIGKILLed
driver leaves no actor, stage process or shared-memory segment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from omnistage import Omni
from omnistage.outputs import RequestEvent
from omnistage.testing.processes import alive
from omnistage.testing.toy_pipeline import toy_graph_yaml

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

PROMPTS = [{"prompt_token_ids": list(range(5 + i, 25 + i))} for i in range(6)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    nodes = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_a": 100}, "include_dashboard": False})
    try:
        nodes.add_node(num_cpus=2, resources={"node_b": 100})
        ray.init(address=nodes.address)
        nodes.wait_for_nodes()
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


def _ray_graph(model: Path, max_tokens: int, **kw: object) -> str:
    """The toy graph on the cluster: the middle stage (its replicas) on node_b, the rest on
    node_a."""
    text = toy_graph_yaml(model, chunked=True, backend="ray", connector="auto",
                          max_tokens=max_tokens, **kw)
    for name, node in (("first", "node_a"), ("vectors", "node_a")):
        text = text.replace(f"  - name: {name}\n",
                            f"  - name: {name}\n    placement: {{ray_resources: {{{node}: 1}}}}\n")
    # the middle stage has a placement of its own (its replicas)
    return text.replace("    placement:\n      replicas:",
                        "    placement:\n      ray_resources: {node_b: 1}\n      replicas:")


def _wait(predicate, timeout_s: float, what: object) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_stages_on_two_nodes_serve_as_the_process_backend(cluster: object,
                                                          tiny_qwen3: Path) -> None:
    with Omni(stage_config=toy_graph_yaml(tiny_qwen3, chunked=True, max_tokens=12),
              device="cpu") as omni:
        reference = omni.generate(PROMPTS)
    text = _ray_graph(tiny_qwen3, 12, second_replicas=2)
    text = text.replace("    final: text\n", "    final: text\n    parallel: {tp: 2}\n")
    with Omni(stage_config=text, device="cpu") as omni:
        outs = omni.generate(PROMPTS)
        orch = omni.engine.orchestrator
        stats = orch.stage_stats()
        stages = orch.stages
        node_a = stages.host.node
        assert stages.nodes[("first", 0)] == stages.nodes[("vectors", 0)] == node_a
        assert {rank.node for rank in stages.runners["first"][0].processes} == {node_a}
        assert stages.nodes[("second", 0)] == stages.nodes[("second", 1)] != node_a
        # tcp where the ends sit on two nodes, shm (no tcp peer) where they share one
        assert stages.peers_of("first", 0) == {
            "first->second#0": stages.addresses[("second", 0)],
            "first->second#1": stages.addresses[("second", 1)]}
        assert stages.peers_of("second", 1) == {"second->vectors": stages.addresses[("vectors", 0)]}
        assert stages.peers_of("vectors", 0) == {}
    for out, ref in zip(outs, reference):
        assert out.error is None and out.finished
        assert out.token_ids == ref.token_ids
        assert torch.equal(out.tensors["vectors"], ref.tensors["vectors"])
    for key in ("second#0", "second#1"):   # six at once, least outstanding first: 3 each
        assert stats[key].num_output_tokens == 3 * 12, (key, stats[key].num_output_tokens)


def test_a_killed_replica_actor_fails_only_its_requests_and_restarts(
        cluster: object, tiny_qwen3: Path) -> None:
    text = _ray_graph(tiny_qwen3, 200, second_replicas=2)
    text = text.replace("      replicas: 2\n",
                        "      replicas: 2\n      max_restarts: 1\n    timeouts: {input_s: 2.0}\n")
    with Omni(stage_config=text, device="cpu") as omni:
        orch = omni.engine.orchestrator
        events: dict[str, list[RequestEvent]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        for (rid, evs), prompt in zip(events.items(), PROMPTS):
            omni.engine.submit(prompt, None, rid, None, evs.append)
        placed = {rid: orch._routes[rid].replicas["second"] for rid in events}
        _wait(lambda: all(any(e.tensors for e in evs) for evs in events.values()), 20,
              "no output")
        killed_at = time.monotonic()
        ray.kill(orch.stages.runners["second"][1].processes[0].actor)
        _wait(lambda: orch.degraded_reason is not None, 10, "replica 1 not seen dead")
        assert "(restarting)" in orch.degraded_reason and omni.is_healthy
        assert "replica 1 lost its Ray actor (ActorDiedError)" in orch.degraded_reason
        _wait(lambda: all(evs and evs[-1].done for evs in events.values()), 30,
              {rid: evs[-1:] for rid, evs in events.items()})
        failed = [rid for rid, evs in events.items() if evs[-1].error is not None]
        assert sorted(failed) == sorted(r for r, p in placed.items() if p == 1)
        for rid, evs in events.items():
            if rid in failed:
                assert "stage 'second' replica 1 died" in str(evs[-1].error), evs[-1].error
                assert evs[-1].error.kind == "stage_dead"
            else:
                assert sum(len(e.tensors["vectors"]) for e in evs if e.tensors) == 200
        _wait(lambda: orch.degraded_reason is None, 60, orch.degraded_reason)
        recovery_s = time.monotonic() - killed_at
        outs = omni.generate([{**p, "prompt_token_ids": p["prompt_token_ids"][:8]}
                              for p in PROMPTS[:4]], use_tqdm=False)
        assert all(o.error is None and o.finished for o in outs)
        # two of them on the restarted replica: its producer learnt its new tcp address
        assert orch.stage_stats()["second#1"].num_output_tokens == 2 * 200
        _stalled_upstream_fails_at_the_deadline(omni)
    print(f"\nray.kill of one replica under load: {len(failed)} failed (its own), "
          f"{len(events) - len(failed)} completed, healthy again after {recovery_s:.1f} s")


# a driver that serves (four requests running), holds a segment of its own on its node (a
# client tensor no stage has taken yet), then waits to be killed
def _stalled_upstream_fails_at_the_deadline(omni: Omni) -> None:
    """The first stage's process stopped (SIGSTOP) mid-request: the second stage, on the other
    node, fails the request once its input_timeout_s passes without a chunk."""
    pid = omni.engine.orchestrator.stages.runners["first"][0].pid
    events: list[RequestEvent] = []
    omni.engine.submit(PROMPTS[0], None, "stalled", None, events.append)
    _wait(lambda: events, 10, "no output")
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        _wait(lambda: events[-1].done, 15, events[-3:])
        waited = time.monotonic() - stopped
    finally:
        os.kill(pid, signal.SIGCONT)
    assert events[-1].error.kind == "timeout", events[-1].error
    assert "no input from first for 2 s" in str(events[-1].error)
    assert 1.9 < waited < 6.0, waited


DRIVER = """
import json, sys, time
import ray, torch
from omnistage import Omni
from omnistage.connectors.base import ChunkKey
ray.init(address=sys.argv[1])
omni = Omni(stage_config=sys.stdin.read(), device="cpu")
orch = omni.engine.orchestrator
for i in range(4):
    omni.engine.submit({"prompt_token_ids": list(range(5 + i, 25 + i))}, None, f"r{i}", None,
                       lambda event: None)
orch.stages.inputs.put(ChunkKey("r0", "client->first", 1), {"x": torch.zeros(8)})
pids = [rank.pid for rs in orch.stages.runners.values() for r in rs for rank in r.processes]
actors = [rank.actor._actor_id.hex()
          for rs in orch.stages.runners.values() for r in rs for rank in r.processes]
print(json.dumps({"pids": pids, "actors": actors,
                  "namespace": orch.resources["shm_namespace"]}), flush=True)
time.sleep(300)
"""


def test_a_killed_driver_leaves_no_actor_process_or_segment(cluster: object,
                                                            tiny_qwen3: Path) -> None:
    text = _ray_graph(tiny_qwen3, 100000, second_replicas=2)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, cluster.address],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])})
    try:
        driver.stdin.write(text)
        driver.stdin.close()
        line = _read_line(driver, 60)
        placed = json.loads(line)
        assert len(placed["pids"]) == 4 and all(alive(p) for p in placed["pids"])
        prefix = placed["namespace"]
        assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(5)
        _wait(lambda: not [p for p in placed["pids"] if alive(p)], 30, "stage processes left")
        _wait(lambda: not _alive_actors(placed["actors"]), 30, "actors left")
        _wait(lambda: not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)], 5,
              "segments left")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(5)


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    """The driver's first stdout line, within a deadline."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(process.stdout, selectors.EVENT_READ)
    assert sel.select(timeout_s), "the driver printed nothing"
    line = process.stdout.readline()
    assert line, f"the driver ended: {process.poll()}"
    return line


def _alive_actors(actor_ids: list[str]) -> list[str]:
    """Which of these actors the cluster's control store (GCS) does not have dead: what
    `ray list actors` shows, without the dashboard that command needs."""
    from ray._private import state

    table = state.actors()
    return [a for a in actor_ids if table.get(a, {}).get("State") != "DEAD"]
