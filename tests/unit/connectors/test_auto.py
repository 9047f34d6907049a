"""AutoConnector: an edge with a tcp peer goes by tcp, any other by shared memory; the consumer
reads each handle by its kind; release and close free both sides."""

from __future__ import annotations

import os

import torch

from omnistage.connectors import ChunkKey
from omnistage.connectors.auto import AutoConnector
from omnistage.connectors.shm import new_namespace


def test_each_edge_goes_the_way_its_peers_say() -> None:
    namespace = new_namespace()
    consumer = AutoConnector(namespace, listen="tcp://127.0.0.1:0")
    producer = AutoConnector(namespace, inline_bytes=0)
    try:
        producer.set_peers({"a->far#1": consumer.address})
        big = {"x": torch.arange(5000, dtype=torch.float32).reshape(50, 100)}
        far = producer.put(ChunkKey("r", "a->far#1", 0), big)
        near = producer.put(ChunkKey("r", "a->near", 0), big)
        assert (far.kind, near.kind) == ("tcp", "shm")
        assert [n for n in os.listdir("/dev/shm") if n.startswith(namespace)]
        for handle in (far, near):
            assert torch.equal(consumer.get(handle)["x"], big["x"])
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(namespace)]
        assert producer.stats.num_put == 2 and consumer.stats.num_get == 2
        producer.set_peers({})                  # the whole table: that edge is local now
        assert producer.put(ChunkKey("r", "a->far#1", 1), big).kind == "shm"
        assert producer.release("r") == 1
    finally:
        producer.close()
        consumer.close()

