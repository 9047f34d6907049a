"""Stages on streams of their own (`placement.stream_priority`, backend inproc): the stage's
thread runs on a stream of that priority, and a tensor handed from one stream to another
through the inproc connector is read only after the producer wrote it."""

from __future__ import annotations

import threading

import pytest
import torch

from omnistage.configs.schema import GraphConfig
from omnistage.configs.strict import from_dict
from omnistage.connectors.base import ChunkKey
from omnistage.connectors.inproc import InprocConnector
from omnistage.stages.launch import WorkerSpec
from omnistage.stages.process import use_device

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_stage_thread_runs_on_a_stream_of_its_priority() -> None:
    graph = from_dict(GraphConfig, {"backend": "inproc", "connector": "inproc", "stages": [
        {"name": "a", "kind": "ar", "final": "text", "placement": {"stream_priority": -1}}]})
    spec = WorkerSpec(stage="a", graph=graph, inbox="inproc://x", outbox="inproc://y",
                      device="cuda:0", shm_namespace="", run_dir="")
    seen: dict[str, int] = {}

    def stage_thread() -> None:
        use_device(spec)
        stream = torch.cuda.current_stream()
        seen["priority"] = stream.priority
        seen["default"] = int(stream == torch.cuda.default_stream())

    thread = threading.Thread(target=stage_thread)
    thread.start()
    thread.join(timeout=30)
    low, high = torch.cuda.Stream.priority_range()
    assert seen == {"priority": max(-1, high), "default": 0}
    assert torch.cuda.current_stream() == torch.cuda.default_stream()   # this thread's is its own


def test_inproc_hand_off_between_streams_waits_for_the_producer() -> None:
    conn = InprocConnector()
    producer, consumer = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)
    for i in range(3):
        with torch.cuda.stream(producer):
            torch.cuda._sleep(200_000_000)     # ~0.1 s of GPU time before the value is written
            x = torch.full((1 << 22,), float(i + 1), device="cuda")
            handle = conn.put(ChunkKey("r", "a->b", i), {"x": x})
        with torch.cuda.stream(consumer):
            got = conn.get(handle, device="cuda")["x"]
            total = got.sum().item()       # read back on the consumer's stream too
        assert total == float(i + 1) * (1 << 22)
