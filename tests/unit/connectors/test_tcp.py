"""TcpConnector over zmq on 127.0.0.1: routing by edge, out-of-order arrival, timeouts, release,
and an echo across a spawned process."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import msgspec
import pytest
import torch
import zmq
from torch import Tensor

from omnistage.connectors import ChunkKey, TensorHandle
from omnistage.connectors.tcp import TcpConnector

Check = Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], None]

pytestmark = pytest.mark.filterwarnings("error")

EDGE = "a->b"


@pytest.fixture
def pair() -> Iterator[tuple[TcpConnector, TcpConnector]]:
    consumer = TcpConnector(listen="tcp://127.0.0.1:0", timeout_s=10)
    producer = TcpConnector(peers={EDGE: consumer.address})
    yield producer, consumer
    producer.close()
    consumer.close()


def key(request_id: str, chunk_idx: int) -> ChunkKey:
    return ChunkKey(request_id, EDGE, chunk_idx)


def test_round_trip(pair: tuple[TcpConnector, TcpConnector], payload: dict[str, Tensor],
                    assert_same: Check) -> None:
    producer, consumer = pair
    handle = producer.put(key("r1", 0), payload)
    assert handle.kind == "tcp" and handle.location == consumer.address
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(handle), type=TensorHandle)
    assert_same(consumer.get(wire), payload)
    assert consumer.num_buffered == 0
    s_put, s_get = producer.stats, consumer.stats
    assert (s_put.num_put, s_get.num_get) == (1, 1)
    assert s_put.bytes_put == s_get.bytes_got == handle.nbytes > 0


def test_large_and_empty_chunks(pair: tuple[TcpConnector, TcpConnector]) -> None:
    producer, consumer = pair
    big = {"h": torch.randn(1024, 2048).to(torch.bfloat16)}  # 4 MiB, sent without a copy
    h_big = producer.put(key("r1", 0), big)
    h_empty = producer.put(key("r1", 1), {})
    assert consumer.get(h_empty) == {}
    assert torch.equal(consumer.get(h_big)["h"], big["h"])


def test_out_of_order_and_interleaved(pair: tuple[TcpConnector, TcpConnector]) -> None:
    producer, consumer = pair
    handles = {(rid, idx): producer.put(key(rid, idx), {"v": torch.tensor([idx, ord(rid[-1])])})
               for idx in range(4) for rid in ("r1", "r2")}
    for (rid, idx) in sorted(handles, key=lambda k: (-k[1], k[0])):
        out = consumer.get(handles[(rid, idx)])
        assert out["v"].tolist() == [idx, ord(rid[-1])]
    assert consumer.num_buffered == 0


def test_timeout_names_the_key(pair: tuple[TcpConnector, TcpConnector]) -> None:
    producer, consumer = pair
    handle = producer.put(key("r1", 0), {"x": torch.ones(1)})
    missing = TensorHandle(key=key("r1", 5), kind="tcp", tensors=[])
    named = r"ChunkKey\(request_id='r1', edge='a->b', chunk_idx=5\)"
    with pytest.raises(TimeoutError, match=named):
        consumer.get(missing, timeout_s=0.2)
    assert consumer.get(handle)["x"].item() == 1.0  # the chunk that did arrive is still there


def test_release_drops_buffered_and_late_chunks(pair: tuple[TcpConnector, TcpConnector]) -> None:
    producer, consumer = pair
    producer.put(key("r1", 0), {"x": torch.ones(8)})
    producer.put(key("r1", 1), {"x": torch.ones(8)})
    # one PUSH -> one PULL keeps order: once r2's chunk is here, r1's are buffered
    consumer.get(producer.put(key("r2", 0), {"x": torch.ones(1)}))
    assert consumer.num_buffered == 2
    assert consumer.release("r1") == 2
    assert consumer.num_buffered == 0
    producer.put(key("r1", 2), {"x": torch.ones(8)})  # arrives after the abort
    consumer.get(producer.put(key("r2", 1), {"x": torch.ones(1)}))
    assert consumer.num_buffered == 0
    assert consumer.release("r1") == 0 and producer.release("r1") == 0


def test_routing_by_edge() -> None:
    with TcpConnector(listen="tcp://127.0.0.1:0") as b, \
            TcpConnector(listen="tcp://127.0.0.1:0") as c, \
            TcpConnector(peers={"a->b": b.address}) as a:
        a.add_peer("a->c", c.address)
        h_b = a.put(ChunkKey("r", "a->b", 0), {"x": torch.tensor(1)})
        h_c = a.put(ChunkKey("r", "a->c", 0), {"x": torch.tensor(2)})
        assert (h_b.location, h_c.location) == (b.address, c.address)
        assert c.get(h_c)["x"].item() == 2 and b.get(h_b)["x"].item() == 1
        with pytest.raises(ValueError, match="'a->d'"):
            a.put(ChunkKey("r", "a->d", 0), {"x": torch.tensor(3)})
        with pytest.raises(ValueError, match="no listen address"):
            a.get(h_b)


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "tcp://127.0.0.1", "ipc:///tmp/x"])
def test_listen_is_checked(listen: str) -> None:
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        TcpConnector(listen=listen)


def test_explicit_port_and_port_in_use() -> None:
    with TcpConnector(listen="tcp://127.0.0.1:0") as first:
        port = int(first.address.rsplit(":", 1)[1])
        with pytest.raises(zmq.ZMQError):
            TcpConnector(listen=f"tcp://127.0.0.1:{port}")  # closes its context on the way out
    with TcpConnector(listen=f"tcp://127.0.0.1:{port}") as again:
        assert again.address == f"tcp://127.0.0.1:{port}"


def test_close_is_idempotent() -> None:
    conn = TcpConnector(listen="tcp://127.0.0.1:0", peers={EDGE: "tcp://127.0.0.1:1"})
    conn.put(key("r1", 0), {"x": torch.ones(1)})  # nobody listens there: queued, dropped on close
    conn.close()
    conn.close()
    assert conn.ctx.closed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors(pair: tuple[TcpConnector, TcpConnector], payload: dict[str, Tensor],
                      assert_same: Check) -> None:
    producer, consumer = pair
    on_gpu = {name: t.cuda() for name, t in payload.items()}
    assert_same(consumer.get(producer.put(key("r1", 0), on_gpu)), payload)
    out = consumer.get(producer.put(key("r1", 1), on_gpu), device="cuda")
    assert all(t.is_cuda for t in out.values())
    assert_same({name: t.cpu() for name, t in out.items()}, payload)


def test_discard_drops_one_chunk_buffered_or_late(pair: tuple[TcpConnector, TcpConnector]
                                                  ) -> None:
    producer, consumer = pair
    buffered = producer.put(key("r1", 0), {"x": torch.ones(8)})
    consumer.get(producer.put(key("r2", 0), {"x": torch.ones(1)}))   # r1's 0 is here now
    consumer.discard(buffered)
    assert consumer.num_buffered == 0
    late = TensorHandle(key=key("r1", 1), kind="tcp", tensors=[], nbytes=0)
    consumer.discard(late)                 # before it arrives: dropped on arrival
    producer.put(key("r1", 1), {"x": torch.ones(8)})
    kept = producer.put(key("r1", 2), {"x": torch.full((8,), 3.0)})
    assert consumer.get(kept)["x"].eq(3.0).all()   # the request's other chunks still come
    assert consumer.num_buffered == 0 and not consumer.discarded
