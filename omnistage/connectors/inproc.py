"""InprocConnector: producer and consumer in one process; the payload waits in a dict.

Used when stages run in-process (tests, debugging). `put` clones each tensor (contiguous, on the
device it came from), so the producer may reuse its buffers at once; `get` pops the clones and
moves them to the requested device (CPU by default), so a same-device hand-off costs one copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import torch
from torch import Tensor

from omnistage.connectors.base import ChunkKey, Connector, TensorHandle
from omnistage.connectors.packing import plan


class InprocConnector(Connector):
    kind = "inproc"

    def __init__(self) -> None:
        super().__init__()
        self.chunks: dict[ChunkKey, dict[str, Tensor]] = {}
        # stage threads and the orchestrator's release a request's chunks at the same time
        self._lock = threading.Lock()

    def put(self, key: ChunkKey, tensors: Mapping[str, Tensor]) -> TensorHandle:
        start = time.perf_counter()
        metas, nbytes = plan(tensors)
        clones = {name: t.detach().clone(memory_format=torch.contiguous_format)
                  for name, t in tensors.items()}
        with self._lock:
            assert key not in self.chunks, f"chunk {key} was put twice"
            self.chunks[key] = clones
        self.stats.add_put(nbytes, time.perf_counter() - start)
        return TensorHandle(key=key, kind=self.kind, tensors=metas, nbytes=nbytes)

    def get(self, handle: TensorHandle,
            device: torch.device | str | None = None) -> dict[str, Tensor]:
        start = time.perf_counter()
        self.check_handle(handle)
        with self._lock:
            tensors = self.chunks.pop(handle.key, None)
        if tensors is None:
            raise KeyError(f"inproc connector holds no chunk {handle.key} "
                           "(already consumed or released)")
        target = torch.device("cpu" if device is None else device)
        out = {name: t.to(target) for name, t in tensors.items()}
        self.stats.add_get(handle.nbytes, time.perf_counter() - start)
        return out

    def release(self, request_id: str) -> int:
        with self._lock:
            keys = [key for key in self.chunks if key.request_id == request_id]
            for key in keys:
                del self.chunks[key]
        return len(keys)

    def discard(self, handle: TensorHandle) -> None:
        with self._lock:
            self.chunks.pop(handle.key, None)

    def close(self) -> None:
        with self._lock:
            self.chunks.clear()
