"""AutoConnector: shm or tcp per edge, for stages spread over several hosts (backend ray).

A stage's consumers may sit on its own node (shared memory is the cheap way there) or on
another (only tcp reaches it). One instance holds both and picks per chunk by its edge: an edge
with a tcp peer address goes by tcp, every other by shm. Whoever knows where the stages run
(the orchestrator's StageSet, from each stage's Ready) hands out the tcp peers: the edges whose
two ends are on different nodes.

    put(key)      key.edge in tcp peers -> tcp (pushed to that consumer), else shm
    get(handle)   by handle.kind: the producer chose, the handle says which
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from omnistage.connectors.base import ChunkKey, Connector, TensorHandle
from omnistage.connectors.shm import INLINE_BYTES, ShmConnector
from omnistage.connectors.tcp import TcpConnector


class AutoConnector(Connector):
    kind = "auto"

    def __init__(self, namespace: str, listen: str | None = None,
                 inline_bytes: int = INLINE_BYTES, tag: str | None = None) -> None:
        """namespace, inline_bytes, tag: the shm side's; listen: where tcp chunks for this
        stage arrive ("tcp://NODE_IP:0"; None: this instance only sends)."""
        super().__init__()
        self.shm = ShmConnector(namespace, inline_bytes=inline_bytes, tag=tag)
        self.tcp = TcpConnector(listen=listen)
        self.shm.stats = self.tcp.stats = self.stats     # one set of counters for both

    @property
    def address(self) -> str:
        return self.tcp.address if self.tcp.pull is not None else ""

    def set_peers(self, peers: Mapping[str, str]) -> None:
        """The edges that cross nodes, and their consumers' addresses (all others: shm)."""
        self.tcp.set_peers(peers)

    def put(self, key: ChunkKey, tensors: Mapping[str, Tensor]) -> TensorHandle:
        if key.edge in self.tcp.peers:
            return self.tcp.put(key, tensors)
        return self.shm.put(key, tensors)

    def get(self, handle: TensorHandle,
            device: torch.device | str | None = None) -> dict[str, Tensor]:
        if handle.kind == "tcp":
            return self.tcp.get(handle, device)
        return self.shm.get(handle, device)

    def release(self, request_id: str) -> int:
        return self.shm.release(request_id) + self.tcp.release(request_id)

    def discard(self, handle: TensorHandle) -> None:
        (self.tcp if handle.kind == "tcp" else self.shm).discard(handle)

    def close(self) -> None:
        self.shm.close()
        self.tcp.close()
