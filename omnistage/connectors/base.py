"""What every connector shares: the chunk key, the handle that travels in control messages,
the stats, and the `Connector` interface.

A connector moves a *payload* (a dict of named tensors) from a producer stage to a consumer
stage. The data and the control message that references it travel separately:

    producer stage                           orchestrator / zmq                consumer stage
    handle = conn.put(key, tensors)  --->  StageOutput(..., handle)  --->  conn.get(handle)
                 |                                                              ^
                 +---------- bytes: dict, /dev/shm segment, or tcp frame -------+

The handle is a small msgspec struct (msgpack on the wire); the tensors themselves travel as raw
bytes plus dtype name and shape (see `packing.py`), never pickled.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import ClassVar

import msgspec
import torch
from torch import Tensor


class ChunkKey(msgspec.Struct, frozen=True, array_like=True):
    """Names one chunk of one edge of one request; hashable."""

    request_id: str
    edge: str        # e.g. "thinker->talker"; the tcp connector routes on it
    chunk_idx: int


class TensorMeta(msgspec.Struct, array_like=True):
    """Where one tensor lies in a chunk's byte buffer (see `packing.py`)."""

    name: str
    dtype: str        # torch dtype without the "torch." prefix, e.g. "bfloat16"
    shape: list[int]
    offset: int       # bytes from the start of the buffer, a multiple of 64
    nbytes: int


class TensorHandle(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a control message carries instead of the tensors."""

    key: ChunkKey
    kind: str                 # the connector kind that made it: "inproc" | "shm" | "tcp"
    tensors: list[TensorMeta]
    location: str = ""        # shm: segment name; tcp: the consumer address it was sent to
    nbytes: int = 0           # size of the chunk's byte buffer, padding included
    data: bytes = b""         # the buffer itself, for a payload small enough to travel inline


@dataclass(slots=True)
class ConnectorStats:
    """Counters for metrics; bytes are buffer bytes (padding included)."""

    bytes_put: int = 0
    bytes_got: int = 0
    num_put: int = 0
    num_get: int = 0
    put_seconds: float = 0.0
    get_seconds: float = 0.0

    def add_put(self, nbytes: int, seconds: float) -> None:
        self.bytes_put += nbytes
        self.num_put += 1
        self.put_seconds += seconds

    def add_get(self, nbytes: int, seconds: float) -> None:
        self.bytes_got += nbytes
        self.num_get += 1
        self.get_seconds += seconds


class Connector(ABC):
    """Moves payloads keyed by `ChunkKey`. One instance per stage process; not thread-safe.

    - `put` copies the tensors out (the caller may reuse or mutate them afterwards); non-contiguous
      tensors are made contiguous and CUDA tensors are copied to host memory.
    - `get` consumes: after it returns, the connector holds nothing for that chunk. It returns CPU
      tensors, or tensors on `device` when given.
    - `release(request_id)` frees whatever is still held for a finished or aborted request.
    - `discard(handle)` frees one chunk its consumer will never take (a chunk that reached a
      stage after it had finished the request: the request's other chunks, for stages still
      working on it or for the client, stay).
    - `close()` frees everything; the connector is unusable afterwards.
    """

    kind: ClassVar[str]

    def __init__(self) -> None:
        self.stats = ConnectorStats()

    @abstractmethod
    def put(self, key: ChunkKey, tensors: Mapping[str, Tensor]) -> TensorHandle: ...

    @abstractmethod
    def get(self, handle: TensorHandle,
            device: torch.device | str | None = None) -> dict[str, Tensor]: ...

    @abstractmethod
    def release(self, request_id: str) -> int:
        """Free every chunk still held for `request_id`; returns how many were freed."""

    @abstractmethod
    def discard(self, handle: TensorHandle) -> None:
        """Free the one chunk `handle` names, if still held (never waits for it)."""

    @abstractmethod
    def close(self) -> None: ...

    @property
    def address(self) -> str:
        """Where this connector receives chunks sent to it directly ("" where nothing is:
        only the tcp connector has one)."""
        return ""

    def check_handle(self, handle: TensorHandle) -> None:
        if handle.kind != self.kind:
            raise ValueError(f"{self.kind} connector got a {handle.kind!r} handle for {handle.key}")

    def __enter__(self) -> Connector:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# kind -> (module, class); imported lazily so that e.g. "inproc" never imports zmq
CONNECTORS: dict[str, tuple[str, str]] = {
    "inproc": ("omnistage.connectors.inproc", "InprocConnector"),
    "shm": ("omnistage.connectors.shm", "ShmConnector"),
    "tcp": ("omnistage.connectors.tcp", "TcpConnector"),
    "auto": ("omnistage.connectors.auto", "AutoConnector"),
}


def make_connector(kind: str, **kwargs: object) -> Connector:
    """Build a connector by kind; `kwargs` go to its constructor."""
    if kind not in CONNECTORS:
        raise ValueError(f"connector: unknown kind {kind!r} (expected one of {sorted(CONNECTORS)})")
    module_name, class_name = CONNECTORS[kind]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**kwargs)
