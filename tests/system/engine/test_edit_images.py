"""An edit's input image goes to the diffusion stage through the connector, not in the control
message; it is decoded once; and every way a request ends frees its shared memory: drawn,
refused by the stage, aborted before the stage took it, the stage dead."""

from __future__ import annotations

import io
import os
import queue
import signal
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from PIL import Image

from omnistage import Omni
from omnistage.diffusion import image_input
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams, ImageRef
from omnistage.diffusion.pipelines.digits import DigitsPipeline
from omnistage.models.digits_dit import DigitsDiT
from omnistage.outputs import RequestEvent
from omnistage.stages import messages as m
from omnistage.testing.diffusion import run_to_end

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="lists /dev/shm (Linux)")


@pytest.fixture(scope="module")
def image_file() -> bytes:
    start = Image.new("RGB", (24, 24))
    start.paste((255, 255, 255), (8, 2, 16, 22))              # a light bar on black: a "1"
    buf = io.BytesIO()
    start.save(buf, format="PNG")
    return buf.getvalue()


def graph(model: Path, backend: str, connector: str) -> str:
    return (f"model: {model}\nbackend: {backend}\nconnector: {connector}\nstages:\n"
            "  - {name: dit, kind: diffusion, component: digits_dit, final: image}\n")


def segments(namespace: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(namespace + "_"))


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_the_image_file_travels_through_the_connector(random_digits: Path, image_file: bytes,
                                                      connector: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The AddRequest carries a handle and an ImageRef, never the file; the engine decodes it
    once; the images equal the engine's alone; a refused edit leaves no segment behind."""
    params = DiffusionParams(num_inference_steps=4, seed=2, image=image_file, strength=0.5)
    alone = DiffusionEngine(DigitsPipeline(DigitsDiT.from_pretrained(random_digits),
                                           torch.device("cpu")))
    alone.add_request("ref", "one", params)
    ref = run_to_end(alone)["ref"]
    decodes = []
    decode = image_input.decode_image
    monkeypatch.setattr(image_input, "decode_image", lambda *a: decodes.append(1) or decode(*a))
    with Omni(stage_config=graph(random_digits, "inproc", connector), device="cpu") as omni:
        orchestrator = omni.engine.orchestrator
        namespace = orchestrator.resources["shm_namespace"]
        sent: list[m.ToStage] = []
        send = orchestrator.stages.send
        monkeypatch.setattr(orchestrator.stages, "send",
                            lambda stage, replica, msg: sent.append(msg)
                            or send(stage, replica, msg))
        (out,) = omni.generate("one", params)
        assert out.error is None and torch.equal(out.tensors["images"], ref.images)
        assert out.stage_metrics["dit"].num_steps == 2
        assert len(decodes) == 1                        # by the engine; the front door peeks
        (add,) = [msg for msg in sent if isinstance(msg, m.AddRequest)]
        assert add.diffusion.image == ImageRef(len(image_file))
        assert add.diffusion.strength == 0.5
        assert add.inputs is not None and add.inputs.location and not add.inputs.data
        assert add.inputs.nbytes >= len(image_file)
        assert image_file not in m.encode(add)

        (refused,) = omni.generate("a picture of a cat", params)    # the stage refuses it
        assert refused.error.kind == "invalid_input" and "digit" in str(refused.error)
        with pytest.raises(ValueError, match="strength"):
            omni.generate("one", DiffusionParams(strength=0.5))
        assert segments(namespace) == []


def test_aborted_and_orphaned_images_are_freed(random_digits: Path, image_file: bytes) -> None:
    """In a stage process: an edit aborted while the stage has not taken it yet, and one whose
    stage dies before taking it; their segments go at once (the abort; the death noticed)."""
    params = DiffusionParams(num_inference_steps=2, seed=0, image=image_file, strength=0.5)
    events: queue.Queue[RequestEvent] = queue.Queue()
    with Omni(stage_config=graph(random_digits, "process", "shm"), device="cpu") as omni:
        engine = omni.engine
        namespace = engine.orchestrator.resources["shm_namespace"]
        (pid,) = engine.orchestrator.stage_pids().values()
        os.kill(pid, signal.SIGSTOP)                    # the stage takes no message meanwhile
        try:
            engine.submit("one", params, request_id="gone", sink=events.put)
            assert len(segments(namespace)) == 1
            engine.abort("gone")
            assert segments(namespace) == []
        finally:
            os.kill(pid, signal.SIGCONT)
        (again,) = omni.generate("one", params)         # the late AddRequest is dropped
        assert again.error is None and again.images

        os.kill(pid, signal.SIGSTOP)
        engine.submit("one", params, request_id="orphan", sink=events.put)
        assert len(segments(namespace)) == 1
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not engine.is_healthy)
        assert wait_for(lambda: segments(namespace) == [])
        ends = _drain(events)
        assert ends["gone"].finish_reason == "abort"
        assert ends["orphan"].error.kind == "stage_dead"


def _drain(events: queue.Queue[RequestEvent]) -> dict[str, RequestEvent]:
    """The last event of each request that ended."""
    ends = {}
    while not events.empty():
        ev = events.get_nowait()
        if ev.done:
            ends[ev.request_id] = ev
    return ends
