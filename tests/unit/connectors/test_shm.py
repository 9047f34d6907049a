"""ShmConnector: round trips, a consumer in another process, and /dev/shm left clean (the
segment tests turn inline payloads off); small payloads inline in the handle, large ones in a
segment."""

from __future__ import annotations

import os
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


def test_round_trip_unlinks_on_get(namespace: str, payload: dict[str, Tensor],
                                   assert_same: Check) -> None:
    conn = ShmConnector(namespace, inline_bytes=0)
    handle = conn.put(ChunkKey("r1", "a->b", 0), payload)
    assert handle.kind == "shm" and handle.location.startswith(namespace + "_")
    assert len(handle.location) < 30
    assert segments(namespace) == [handle.location]
    assert all(m.offset % 64 == 0 for m in handle.tensors)
    assert_same(conn.get(handle), payload)
    assert segments(namespace) == []
    with pytest.raises(KeyError, match="already consumed"):
        conn.get(handle)
    conn.close()


def test_separate_consumer_instance(namespace: str, payload: dict[str, Tensor],
                                    assert_same: Check) -> None:
    producer, consumer = ShmConnector(namespace, inline_bytes=0), ShmConnector(namespace, inline_bytes=0)
    assert producer.tag != consumer.tag  # one namespace per engine, names never clash
    handles = [producer.put(ChunkKey("r1", "a->b", idx), {"x": torch.full((idx,), idx)})
               for idx in range(3)]
    wire = [msgspec.msgpack.encode(h) for h in handles]
    for idx, data in reversed(list(enumerate(wire))):
        out = consumer.get(msgspec.msgpack.decode(data, type=TensorHandle))
        assert torch.equal(out["x"], torch.full((idx,), idx))
    assert segments(namespace) == []
    assert producer.release("r1") == 0  # all consumed elsewhere: nothing left to unlink
    handle = producer.put(ChunkKey("r2", "a->b", 0), payload)
    assert_same(consumer.get(handle), payload)
    assert (producer.stats.num_put, consumer.stats.num_get) == (4, 4)
    assert producer.stats.bytes_put == consumer.stats.bytes_got > 0


def test_release_frees_unconsumed(namespace: str) -> None:
    conn = ShmConnector(namespace, inline_bytes=0)
    taken = conn.put(ChunkKey("r1", "a->b", 0), {"x": torch.ones(4)})
    for idx in (1, 2):
        conn.put(ChunkKey("r1", "a->b", idx), {"x": torch.ones(4)})
    kept = conn.put(ChunkKey("r2", "a->b", 0), {"x": torch.ones(4)})
    conn.get(taken)
    assert len(segments(namespace)) == 3
    assert conn.release("r1") == 2
    assert segments(namespace) == [kept.location]
    assert conn.release("r1") == 0
    conn.close()
    assert segments(namespace) == []


def test_close_frees_all_and_empty_payloads(namespace: str) -> None:
    conn = ShmConnector(namespace, inline_bytes=0)
    handles = [conn.put(ChunkKey(f"r{i}", "a->b", 0), {"e": torch.empty(0)}) for i in range(3)]
    handles.append(conn.put(ChunkKey("r9", "a->b", 0), {}))
    assert [h.nbytes for h in handles] == [0, 0, 0, 0]
    assert conn.get(handles[3]) == {}
    assert len(segments(namespace)) == 3
    with ShmConnector(namespace, inline_bytes=0) as other:  # context manager closes too
        other.put(ChunkKey("x", "a->b", 0), {"x": torch.ones(1)})
    assert len(segments(namespace)) == 3
    conn.close()
    assert segments(namespace) == []


def test_sweep_removes_only_its_namespace(namespace: str) -> None:
    other_ns = new_namespace()
    mine, theirs = ShmConnector(namespace, inline_bytes=0), ShmConnector(other_ns, inline_bytes=0)
    for idx in range(2):
        mine.put(ChunkKey("r", "a->b", idx), {"x": torch.ones(1)})
    theirs.put(ChunkKey("r", "a->b", 0), {"x": torch.ones(1)})
    assert sweep(namespace) == 2
    assert segments(namespace) == [] and len(segments(other_ns)) == 1
    assert mine.release("r") == 0  # swept already: release tolerates it
    theirs.close()
    assert sweep(other_ns) == 0


def test_small_payloads_travel_inline(namespace: str, payload: dict[str, Tensor],
                                      assert_same: Check) -> None:
    """Up to inline_bytes the buffer rides in the handle (through msgpack, as in a control
    message): no segment, nothing to release; above it, a segment as before."""
    conn = ShmConnector(namespace, inline_bytes=4096)
    small = conn.put(ChunkKey("r1", "a->b", 0), payload)
    assert small.location == "" and len(small.data) == small.nbytes > 0
    assert segments(namespace) == []
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(small), type=TensorHandle)
    assert_same(ShmConnector(namespace).get(wire), payload)     # any instance can read it
    big = {"x": torch.arange(2048, dtype=torch.float32)}        # 8 KiB
    large = conn.put(ChunkKey("r1", "a->b", 1), big)
    assert large.data == b"" and segments(namespace) == [large.location]
    assert torch.equal(conn.get(large)["x"], big["x"])
    empty = conn.put(ChunkKey("r1", "a->b", 2), {"e": torch.empty(0, 3)})
    assert empty.nbytes == 0 and conn.get(empty)["e"].shape == (0, 3)
    assert conn.release("r1") == 0 and segments(namespace) == []
    assert conn.stats.num_put == 3 and conn.stats.bytes_put == small.nbytes + large.nbytes
    conn.close()


@pytest.mark.parametrize("bad", ["", "has_underscore", "x" * 11, "../etc"])
def test_namespace_is_checked(bad: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        ShmConnector(bad)


    # exits without release: the parent consumes the replies after this process is gone


PRODUCER_SCRIPT = """
import sys, torch, msgspec
from omnistage.connectors import ChunkKey
from omnistage.connectors.shm import ShmConnector
conn = ShmConnector(sys.argv[1], inline_bytes=0)
handle = conn.put(ChunkKey("r1", "a->b", 0), {"x": torch.arange(10, dtype=torch.bfloat16)})
print(msgspec.msgpack.encode(handle).hex())
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors(namespace: str, payload: dict[str, Tensor], assert_same: Check) -> None:
    conn = ShmConnector(namespace, inline_bytes=0)
    on_gpu = {name: t.cuda() for name, t in payload.items()}  # "strided" stays non-contiguous
    assert_same(conn.get(conn.put(ChunkKey("r1", "a->b", 0), on_gpu)), payload)
    out = conn.get(conn.put(ChunkKey("r1", "a->b", 1), on_gpu), device=torch.device("cuda"))
    assert all(t.is_cuda for t in out.values())
    assert_same({name: t.cpu() for name, t in out.items()}, payload)


def test_discard_unlinks_that_segment_only(namespace: str) -> None:
    producer = ShmConnector(namespace, inline_bytes=0)
    consumer = ShmConnector(namespace, inline_bytes=0)
    late = producer.put(ChunkKey("r1", "talker->code2wav", 0), {"x": torch.ones(4)})
    kept = producer.put(ChunkKey("r1", "talker->code2wav", 1), {"x": torch.ones(4)})
    consumer.discard(late)                 # any instance may drop it: the name is the handle's
    consumer.discard(late)
    assert segments(namespace) == [kept.location]
    producer.discard(late)                 # the producer forgets it too: release counts 1
    assert producer.release("r1") == 1 and segments(namespace) == []
    inline = ShmConnector(namespace).put(ChunkKey("r1", "a->b", 0), {"x": torch.ones(1)})
    consumer.discard(inline)               # inline: nothing to unlink
    producer.close()
    consumer.close()
