"""TcpConnector over zmq on 127.0.0.1: routing by edge, out-of-order arrival, timeouts, release,
and an echo across a spawned process."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Mapping

import msgspec
import pytest
from torch import Tensor

from omnistage.connectors import ChunkKey, TensorHandle
from omnistage.connectors.tcp import TcpConnector

Check = Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], None]

pytestmark = pytest.mark.filterwarnings("error")

EDGE = "a->b"


def key(request_id: str, chunk_idx: int) -> ChunkKey:
    return ChunkKey(request_id, EDGE, chunk_idx)


def echo(requests: multiprocessing.Queue, replies: multiprocessing.Queue) -> None:
    """Child: bind, announce the address, then get each handle and put it back on edge b->a."""
    conn = TcpConnector(listen="tcp://127.0.0.1:0", timeout_s=30)
    replies.put(conn.address)
    conn.add_peer("b->a", requests.get())
    while (data := requests.get()) is not None:
        handle = msgspec.msgpack.decode(data, type=TensorHandle)
        back = ChunkKey(handle.key.request_id, "b->a", handle.key.chunk_idx)
        replies.put(msgspec.msgpack.encode(conn.put(back, conn.get(handle))))
    requests.get()  # wait until the parent has everything: close() drops unsent data
    conn.close()


def test_echo_across_spawned_process(payload: dict[str, Tensor], assert_same: Check) -> None:
    ctx = multiprocessing.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=echo, args=(requests, replies))
    child.start()
    try:
        with TcpConnector(listen="tcp://127.0.0.1:0") as conn:
            conn.add_peer(EDGE, replies.get(timeout=60))
            requests.put(conn.address)
            for idx in range(3):
                requests.put(msgspec.msgpack.encode(conn.put(key("r1", idx), payload)))
            requests.put(None)
            handles = [msgspec.msgpack.decode(replies.get(timeout=30), type=TensorHandle)
                       for _ in range(3)]
            for handle in reversed(handles):
                assert handle.key.edge == "b->a"
                assert_same(conn.get(handle), payload)
            assert conn.stats.num_get == 3 and conn.stats.bytes_got == conn.stats.bytes_put
            requests.put("done")
        child.join(timeout=30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()

