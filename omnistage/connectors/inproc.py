"""InprocConnector: producer and consumer in one process; the payload waits in a dict.

Used when stages run in-process (tests, debugging). `put` clones each tensor (contiguous, on the
device it came from), so the producer may reuse its buffers at once; `get` pops the clones and
moves them to the requested device (CPU by default), so a same-device hand-off costs one copy.

Stages on one GPU may each run on a stream of their own (`placement.stream_priority`): `put`
records an event on the producer's stream after the clones, and `get` makes the consumer's
stream wait for it and marks the clones as used there (`record_stream`), so the producer's
allocator does not hand their memory out again while the consumer still reads it.
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
        # each chunk's clones, and the event after them on each CUDA device's current stream
        self.chunks: dict[ChunkKey, tuple[dict[str, Tensor], list[torch.cuda.Event]]] = {}
        # stage threads and the orchestrator's release a request's chunks at the same time
        self._lock = threading.Lock()

    def put(self, key: ChunkKey, tensors: Mapping[str, Tensor]) -> TensorHandle:
        start = time.perf_counter()
        metas, nbytes = plan(tensors)
        clones = {name: t.detach().clone(memory_format=torch.contiguous_format)
                  for name, t in tensors.items()}
        with self._lock:
            assert key not in self.chunks, f"chunk {key} was put twice"
            self.chunks[key] = clones, _record_events(clones)
        self.stats.add_put(nbytes, time.perf_counter() - start)
        return TensorHandle(key=key, kind=self.kind, tensors=metas, nbytes=nbytes)

    def get(self, handle: TensorHandle,
            device: torch.device | str | None = None) -> dict[str, Tensor]:
        start = time.perf_counter()
        self.check_handle(handle)
        with self._lock:
            chunk = self.chunks.pop(handle.key, None)
        if chunk is None:
            raise KeyError(f"inproc connector holds no chunk {handle.key} "
                           "(already consumed or released)")
        tensors, events = chunk
        _wait_events(tensors, events)
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


def _record_events(tensors: Mapping[str, Tensor]) -> list[torch.cuda.Event]:
    """An event on the current stream of each CUDA device the tensors are on."""
    events = []
    for device in {t.device for t in tensors.values() if t.is_cuda}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


def _wait_events(tensors: Mapping[str, Tensor], events: list[torch.cuda.Event]) -> None:
    """The consumer's current streams wait for the producer's events; the tensors are marked
    as used on them."""
    if not events:
        return
    streams = {t.device: torch.cuda.current_stream(t.device)
               for t in tensors.values() if t.is_cuda}
    for stream in streams.values():
        for event in events:
            stream.wait_event(event)
    for t in tensors.values():
        if t.is_cuda:
            t.record_stream(streams[t.device])
