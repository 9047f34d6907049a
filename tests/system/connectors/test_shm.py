"""ShmConnector: round trips, a consumer in another process, and /dev/shm left clean (the
segment tests turn inline payloads off); small payloads inline in the handle, large ones in a
segment."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping

import msgspec
import pytest
import torch
from torch import Tensor

from omnistage.connectors import ChunkKey, TensorHandle
from omnistage.connectors.shm import SHM_DIR, ShmConnector, new_namespace, sweep

Check = Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], None]

pytestmark = [pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="lists /dev/shm (Linux)"),
              pytest.mark.filterwarnings("error")]


def segments(namespace: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(namespace + "_"))


@pytest.fixture
def namespace() -> Iterator[str]:
    ns = new_namespace()
    yield ns
    left = segments(ns)
    sweep(ns)
    assert left == [], f"segments left behind: {left}"


def echo(namespace: str, requests: multiprocessing.Queue, replies: multiprocessing.Queue) -> None:
    """Child: take each handle, get it, put the tensors back under chunk_idx + 100."""
    conn = ShmConnector(namespace, inline_bytes=0)
    while (data := requests.get()) is not None:
        handle = msgspec.msgpack.decode(data, type=TensorHandle)
        tensors = conn.get(handle)
        key = ChunkKey(handle.key.request_id, "b->a", handle.key.chunk_idx + 100)
        replies.put(msgspec.msgpack.encode(conn.put(key, tensors)))
    # exits without release: the parent consumes the replies after this process is gone


def test_consumer_in_spawned_process(namespace: str, payload: dict[str, Tensor],
                                     assert_same: Check) -> None:
    ctx = multiprocessing.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=echo, args=(namespace, requests, replies))
    child.start()
    conn = ShmConnector(namespace, inline_bytes=0)
    for idx in range(2):
        requests.put(msgspec.msgpack.encode(conn.put(ChunkKey("r1", "a->b", idx), payload)))
    requests.put(None)
    child.join(timeout=60)
    assert child.exitcode == 0
    # the child's segments outlived it: its resource tracker did not unlink them
    assert len(segments(namespace)) == 2
    for idx in range(2):
        handle = msgspec.msgpack.decode(replies.get(timeout=5), type=TensorHandle)
        assert handle.key.chunk_idx == idx + 100
        assert_same(conn.get(handle), payload)
    assert segments(namespace) == []
    assert conn.release("r1") == 0  # the child consumed ours


PRODUCER_SCRIPT = """
import sys, torch, msgspec
from omnistage.connectors import ChunkKey
from omnistage.connectors.shm import ShmConnector
conn = ShmConnector(sys.argv[1], inline_bytes=0)
handle = conn.put(ChunkKey("r1", "a->b", 0), {"x": torch.arange(10, dtype=torch.bfloat16)})
print(msgspec.msgpack.encode(handle).hex())
"""


def test_producer_exit_leaves_segment_without_tracker_warning(namespace: str) -> None:
    proc = subprocess.run([sys.executable, "-c", PRODUCER_SCRIPT, namespace],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "resource_tracker" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr
    handle = msgspec.msgpack.decode(bytes.fromhex(proc.stdout.strip()), type=TensorHandle)
    assert segments(namespace) == [handle.location]
    out = ShmConnector(namespace, inline_bytes=0).get(handle)
    assert torch.equal(out["x"], torch.arange(10, dtype=torch.bfloat16))

