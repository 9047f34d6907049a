"""The stage-graph runtime end to end on a three-stage toy pipeline (tiny Qwen3 -> tiny Qwen3
fed its hidden states -> a generation stage turning tokens into vectors), over every backend,
connector and edge kind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from omnistage import AsyncOmni, Omni
from omnistage.testing.processes import alive
from omnistage.testing.toy_pipeline import TokenEmbedder, toy_graph_yaml

PROMPTS = [{"prompt_token_ids": list(range(5, 25))}, {"prompt_token_ids": [7, 3, 99, 42]},
           {"prompt_token_ids": list(range(100, 160))}]
MAX_TOKENS = 12

COMBOS = [("inproc", "inproc", False), ("inproc", "inproc", True),
          ("inproc", "shm", False), ("inproc", "shm", True),
          ("inproc", "tcp", False), ("inproc", "tcp", True),
          ("process", "shm", False), ("process", "shm", True),
          ("process", "tcp", False), ("process", "tcp", True)]


def shm_segments(namespace: str = "os") -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(namespace)}


def run(model: Path, backend: str, connector: str, chunked: bool,
        max_tokens: int = MAX_TOKENS) -> tuple[list, dict]:
    yaml_text = toy_graph_yaml(model, chunked=chunked, connector=connector, backend=backend,
                               max_tokens=max_tokens)
    with Omni(stage_config=yaml_text, device="cpu") as omni:
        outs = omni.generate(PROMPTS)
        stats = omni.engine.orchestrator.stage_stats()
        namespace = omni.engine.orchestrator.resources["shm_namespace"]
    assert not shm_segments(namespace), "shared-memory segments left behind"
    return outs, stats


@pytest.fixture(scope="module")
def results(tiny_qwen3: Path) -> dict:
    return {combo: run(tiny_qwen3, *combo) for combo in COMBOS}


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(map(str, c)))
def test_outputs_equal_across_backends_connectors_and_edges(results: dict, combo: tuple,
                                                            tiny_qwen3: Path) -> None:
    outs, stats = results[combo]
    base, _ = results[COMBOS[0]]
    for out, ref in zip(outs, base):
        assert out.error is None and out.finished
        assert out.token_ids == ref.token_ids and out.text == ref.text
        assert torch.equal(out.tensors["vectors"], ref.tensors["vectors"])
        assert out.tensors["vectors"].shape == (MAX_TOKENS, 8)
        assert set(out.stage_metrics) == {"first", "second", "vectors"}
        for sm in out.stage_metrics.values():
            assert sm.queue_time >= 0 and sm.time_in_stage > 0
            assert 0 < sm.time_to_first_output <= sm.time_in_stage
        assert out.stage_metrics["second"].connector_bytes_in > 0
        assert out.stage_metrics["vectors"].connector_bytes_out > 0
        assert out.metrics.queue_time is not None and out.metrics.time_to_first_token > 0
    for name, st in stats.items():  # every stage released every request
        assert st.num_requests == 0 and st.num_engine_requests == 0, name
        if st.num_blocks is not None:
            assert st.num_free_blocks == st.num_blocks, name
        loop = st.loop                # where the stage's loop spent its time
        assert loop["num_steps"] > 0 and loop["step_seconds"] > 0, (name, loop)
        assert loop["num_messages"] >= len(PROMPTS), (name, loop)   # one add each at least
        assert loop["max_step_seconds"] <= loop["step_seconds"], (name, loop)


def test_first_stage_matches_transformers(results: dict, tiny_qwen3: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    outs, _ = results[COMBOS[0]]
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt["prompt_token_ids"]])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, pad_token_id=0)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist()


def test_vectors_are_the_second_stage_tokens_embedded(results: dict) -> None:
    table = TokenEmbedder().table
    outs, _ = results[COMBOS[0]]
    for out in outs:
        vecs = out.tensors["vectors"]
        # every row is some token's vector: recover the tokens and check they embed back
        tokens = torch.cdist(vecs, table).argmin(dim=1)
        assert torch.equal(table[tokens], vecs)


@pytest.mark.parametrize("backend, connector", [("inproc", "inproc"), ("process", "shm")])
def test_chunked_final_output_starts_before_entry_stage_finishes(results: dict, backend: str,
                                                                 connector: str,
                                                                 tiny_qwen3: Path) -> None:
    # 96 tokens: the entry stage runs long enough that two hops of chunk delivery fit well
    # inside it even on a loaded 2-core machine (with 12 tokens a busy CI box could finish
    # the first stage before the last stage's first output: a race, not a runtime property)
    outs, _ = run(tiny_qwen3, backend, connector, True, max_tokens=96)
    for out in outs:
        sm = out.stage_metrics
        assert sm["vectors"].first_output_time < sm["first"].finished_time
        assert sm["second"].first_output_time < sm["first"].finished_time
    whole, _ = results[(backend, connector, False)]
    for out in whole:  # whole edges: downstream only starts after upstream finished
        sm = out.stage_metrics
        assert sm["vectors"].first_output_time >= sm["first"].finished_time


@pytest.mark.parametrize("backend, connector", [("inproc", "inproc"), ("process", "shm")])
def test_abort_mid_stream_releases_everything(tiny_qwen3: Path, backend: str,
                                              connector: str) -> None:
    yaml_text = toy_graph_yaml(tiny_qwen3, chunked=True, connector=connector, backend=backend,
                               max_tokens=400)
    engine = AsyncOmni(stage_config=yaml_text, device="cpu")
    namespace = engine.orchestrator.resources["shm_namespace"]
    try:
        async def go() -> list:
            seen = []
            async for out in engine.generate(PROMPTS[2]):
                seen.append(out)
                if out.delta_tensors:  # the final stage has started: leave mid-stream
                    break
            return seen

        seen = asyncio.run(go())
        assert seen and not seen[-1].finished
        deadline = time.monotonic() + 10
        while True:
            stats = engine.orchestrator.stage_stats()
            if all(s.num_requests == 0 and s.num_engine_requests == 0 for s in stats.values()):
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        for st in stats.values():
            if st.num_blocks is not None:
                assert st.num_free_blocks == st.num_blocks
        assert engine.orchestrator.num_requests == 0
        if connector == "shm":
            time.sleep(0.2)
            assert not shm_segments(namespace)
        # the engine keeps serving
        (out,) = Omni.__new__(Omni).__class__.generate(_wrap(engine), PROMPTS[1])
        assert out.finished and out.error is None
    finally:
        engine.shutdown()
    assert not shm_segments(namespace)


def _wrap(engine: AsyncOmni) -> Omni:
    omni = Omni.__new__(Omni)
    omni.engine, omni.tokenizer = engine, engine.tokenizer
    return omni


def test_killed_stage_fails_its_requests(tiny_qwen3: Path) -> None:
    yaml_text = toy_graph_yaml(tiny_qwen3, chunked=True, connector="shm", backend="process",
                               max_tokens=400)
    with Omni(stage_config=yaml_text, device="cpu") as omni:
        pid = omni.engine.orchestrator.stage_pids()["second"]
        events = []
        omni.engine.submit(PROMPTS[2], None, "victim", None, events.append)
        deadline = time.monotonic() + 10
        while not events:      # in flight (its first output is out): 400 tokens to go
            assert time.monotonic() < deadline, "no output"
            time.sleep(0.005)
        assert not events[-1].done
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not (events and events[-1].done):
            assert time.monotonic() < deadline, events[-3:]
            time.sleep(0.05)
        assert events[-1].error is not None and "'second'" in str(events[-1].error)
        assert events[-1].error.kind == "stage_dead"
        assert events[-1].error.stage == "second"
        assert not omni.is_healthy
        with pytest.raises(RuntimeError, match="unhealthy"):
            omni.generate(PROMPTS[0])


def test_a_stalled_upstream_fails_the_request_at_the_deadline(tiny_qwen3: Path) -> None:
    """The first stage stopped (SIGSTOP) mid-request: the second, waiting for its chunks, fails
    the request once input_timeout_s passes without one (kind "timeout", naming both stages);
    no request waits forever, and the engine serves again once the upstream resumes."""
    yaml_text = toy_graph_yaml(tiny_qwen3, chunked=True, connector="shm", backend="process",
                               max_tokens=400)
    with Omni(stage_config=yaml_text, device="cpu",
              stage_overrides=["second.timeouts.input_s=1.0"]) as omni:
        pid = omni.engine.orchestrator.stage_pids()["first"]
        events = []
        omni.engine.submit(PROMPTS[2], None, "stalled", None, events.append)
        deadline = time.monotonic() + 10
        while not events:
            assert time.monotonic() < deadline, "no output"
            time.sleep(0.005)
        os.kill(pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            while not (events and events[-1].done):
                assert time.monotonic() < stopped + 10, events[-3:]
                time.sleep(0.05)
            waited = time.monotonic() - stopped
        finally:
            os.kill(pid, signal.SIGCONT)
        info = events[-1].error
        assert info.kind == "timeout" and info.stage == "second", events[-1].error
        assert "no input from first for 1 s" in str(events[-1].error)
        assert 0.9 < waited < 4.0, waited
        assert omni.is_healthy
        (out,) = omni.generate([PROMPTS[0]])      # the upstream resumed: served again
        assert out.error is None and out.finished


def test_parent_sigkill_leaves_no_stagealive(tiny_qwen3: Path, tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from omnistage import Omni
        from omnistage.testing.toy_pipeline import toy_graph_yaml
        if __name__ == "__main__":
            omni = Omni(stage_config=toy_graph_yaml({str(tiny_qwen3)!r}, chunked=True,
                                                    max_tokens=400), device="cpu")
            orch = omni.engine.orchestrator
            print(" ".join(map(str, orch.stage_pids().values())), flush=True)
            print(orch.resources["run_dir"], orch.resources["shm_namespace"], flush=True)
            events = []
            omni.engine.submit({{"prompt_token_ids": list(range(5, 60))}}, None, "r", None,
                               events.append)
            while not any(e.tensors for e in events):  # data is in flight between stages
                time.sleep(0.01)
            print("streaming", flush=True)
            time.sleep(60)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        run_dir, namespace = proc.stdout.readline().split()
        assert proc.stdout.readline().strip() == "streaming"
        assert len(pids) == 3 and all(alive(p) for p in pids)
        assert Path(run_dir).is_dir()
        proc.kill()
        proc.wait()
        time.sleep(2.0)
        assert not [p for p in pids if alive(p)]
        assert not Path(run_dir).exists()
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(namespace)]
    finally:
        proc.kill()


def test_stage_startup_failure_names_the_stage(tmp_path: Path, tiny_qwen3: Path) -> None:
    yaml_text = toy_graph_yaml(tiny_qwen3, chunked=True, backend="process").replace(
        "component: token_embedder", "component: no_such_decoder")
    with pytest.raises(RuntimeError, match="'vectors' failed to start.*no_such_decoder"):
        Omni(stage_config=yaml_text, device="cpu")


def test_clean_exit_of_a_script(tmp_path: Path, tiny_qwen3: Path) -> None:
    """A script with stage processes generates and exits: status 0, nothing on stderr about
    leaked semaphores or shared memory (the stage processes end in os._exit)."""
    script = tmp_path / "guarded.py"
    script.write_text(textwrap.dedent(f"""
        from omnistage import Omni
        from omnistage.testing.toy_pipeline import toy_graph_yaml

        if __name__ == "__main__":
            with Omni(stage_config=toy_graph_yaml({str(tiny_qwen3)!r}, chunked=True),
                      device="cpu") as omni:
                (out,) = omni.generate({{"prompt_token_ids": [5, 6, 7]}})
                assert out.error is None, out.error
            print("done")
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("done"), proc.stderr[-3000:]
    assert "leaked" not in proc.stderr and "resource_tracker" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("backend, connector", [("inproc", "inproc"), ("process", "shm")])
def test_stage_error_fails_only_that_request(tiny_qwen3: Path, backend: str,
                                             connector: str) -> None:
    yaml_text = toy_graph_yaml(tiny_qwen3, chunked=True, connector=connector, backend=backend,
                               adapter="testing.fail_marked")
    with Omni(stage_config=yaml_text, device="cpu") as omni:
        events: list = []
        omni.engine.submit(PROMPTS[0], None, "fail-1", None, events.append)
        (ok,) = omni.generate(PROMPTS[1])
        deadline = time.monotonic() + 10
        while not (events and events[-1].done):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert events[-1].finish_reason == "error"
        assert "stage 'second'" in str(events[-1].error) and "marked to fail" in str(events[-1].error)
        assert ok.error is None and ok.tensors["vectors"].shape == (16, 8)
        assert omni.is_healthy
        for st in omni.engine.orchestrator.stage_stats().values():
            assert st.num_requests == 0
