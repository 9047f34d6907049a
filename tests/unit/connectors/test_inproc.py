"""InprocConnector: round trips, consumption, ownership of the producer's tensors, release."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
import torch
from torch import Tensor

from omnistage.connectors import ChunkKey
from omnistage.connectors.inproc import InprocConnector

Check = Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], None]


def test_round_trip(payload: dict[str, Tensor], assert_same: Check) -> None:
    conn = InprocConnector()
    handle = conn.put(ChunkKey("r1", "a->b", 0), payload)
    assert handle.kind == "inproc" and [m.name for m in handle.tensors] == list(payload)
    assert_same(conn.get(handle), payload)


def test_get_consumes() -> None:
    conn = InprocConnector()
    handle = conn.put(ChunkKey("r1", "a->b", 0), {"x": torch.ones(2)})
    conn.get(handle)
    assert conn.chunks == {}
    with pytest.raises(KeyError, match="r1"):
        conn.get(handle)


def test_producer_may_mutate_after_put() -> None:
    conn = InprocConnector()
    x = torch.arange(6.0).view(2, 3)
    handle = conn.put(ChunkKey("r1", "a->b", 0), {"x": x.t()})  # non-contiguous
    x.zero_()
    out = conn.get(handle)["x"]
    assert out.is_contiguous() and torch.equal(out, torch.arange(6.0).view(2, 3).t())


def test_same_key_twice_is_a_bug() -> None:
    conn = InprocConnector()
    conn.put(ChunkKey("r1", "a->b", 0), {"x": torch.ones(1)})
    with pytest.raises(AssertionError, match="put twice"):
        conn.put(ChunkKey("r1", "a->b", 0), {"x": torch.ones(1)})


def test_release_drops_only_that_request() -> None:
    conn = InprocConnector()
    for idx in range(3):
        conn.put(ChunkKey("r1", "a->b", idx), {"x": torch.ones(1)})
    keep = conn.put(ChunkKey("r2", "a->b", 0), {"x": torch.full((1,), 2.0)})
    assert conn.release("r1") == 3
    assert conn.release("r1") == 0
    assert conn.get(keep)["x"].item() == 2.0
    conn.put(ChunkKey("r3", "a->b", 0), {"x": torch.ones(1)})
    conn.close()
    assert conn.chunks == {}


def test_stats_and_device_argument() -> None:
    conn = InprocConnector()
    handle = conn.put(ChunkKey("r1", "a->b", 0),
                      {"x": torch.ones(16), "y": torch.ones(3, dtype=torch.int8)})
    assert handle.nbytes == 64 + 3
    out = conn.get(handle, device=torch.device("cpu"))
    assert out["x"].device.type == "cpu"
    s = conn.stats
    assert (s.num_put, s.bytes_put, s.num_get, s.bytes_got) == (1, 67, 1, 67)
    assert s.put_seconds >= 0 and s.get_seconds >= 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors(payload: dict[str, Tensor], assert_same: Check) -> None:
    conn = InprocConnector()
    on_gpu = {name: t.cuda() for name, t in payload.items()}
    assert_same(conn.get(conn.put(ChunkKey("r1", "a->b", 0), on_gpu)), payload)
    out = conn.get(conn.put(ChunkKey("r1", "a->b", 1), on_gpu), device="cuda")
    assert all(t.is_cuda for t in out.values())
    assert_same({name: t.cpu() for name, t in out.items()}, payload)


def test_release_from_several_threads_at_once() -> None:
    """A stage's thread and the orchestrator's release one request's chunks at the same time
    (a failing talker under the inproc backend); neither may trip over the other's deletes."""
    import sys
    import threading

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)            # switch threads as often as possible
    try:
        conn = InprocConnector()
        errors: list[BaseException] = []

        def release() -> None:
            try:
                conn.release("r1")
            except Exception as exc:   # collected for the assertion
                errors.append(exc)
        for _ in range(30):
            for i in range(300):
                conn.put(ChunkKey("r1", "a->b", i), {"x": torch.zeros(1)})
            threads = [threading.Thread(target=release) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            assert not errors and conn.chunks == {}
    finally:
        sys.setswitchinterval(old)


def test_discard_drops_that_chunk_only() -> None:
    """A chunk that reached a stage done with its request goes; the request's chunk for the
    client (same request, other edge) stays for the orchestrator."""
    conn = InprocConnector()
    late = conn.put(ChunkKey("r1", "llm->talker", 9), {"x": torch.ones(1)})
    client = conn.put(ChunkKey("r1", "code2wav->client", 13), {"x": torch.full((1,), 2.0)})
    conn.discard(late)
    conn.discard(late)                     # twice: nothing left to drop, no error
    assert list(conn.chunks) == [client.key]
    assert conn.get(client)["x"].item() == 2.0
