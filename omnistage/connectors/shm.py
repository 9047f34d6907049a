"""ShmConnector: same-host stages; each chunk is one POSIX shared-memory segment.

    producer                          /dev/shm                    consumer (any process)
    put(key, tensors) --create,write--> <namespace>_<tag>_<n> --open,copy out,unlink--> get(handle)
                      handle.location = "<namespace>_<tag>_<n>"

- namespace: one per engine (default: `new_namespace()`, "os" + 8 hex chars), so the orchestrator
  can `sweep(namespace)` leftovers of crashed stages on shutdown.
- tag: 6 random hex chars per connector instance, so every stage process of one engine can share
  the namespace without name clashes. Names stay under 30 characters (macOS allows 31).

Small payloads (up to `inline_bytes`, 64 KiB by default: a decode step's hidden rows, a frame's
codes) skip the segment: their buffer travels inside the handle (`TensorHandle.data`), so the
control message carries them. A segment costs a create, map, unmap and unlink on each side
(about 0.25 ms together), which at one chunk per request per step was a quarter of a busy
talker's time.

Ownership is explicit. Python 3.11's resource tracker would unlink a segment when the process that
created *or attached* it exits (and warn), so every segment we create or open is unregistered
from it at once, and we unlink with `shm_unlink` ourselves: the consumer after copying out, the
producer on `release(request_id)` for segments nobody consumed, and on `close()`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import secrets
import time
from collections.abc import Mapping
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import _posixshmem
import torch
from torch import Tensor

from omnistage.connectors.base import ChunkKey, Connector, TensorHandle
from omnistage.connectors.packing import plan, read, write

SHM_DIR = "/dev/shm"
MAX_NAME_LEN = 29
INLINE_BYTES = 64 * 1024
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9]{1,10}")


def new_namespace() -> str:
    """A fresh engine-wide namespace, e.g. "os3f9a0c1d"."""
    return "os" + secrets.token_hex(4)


def check_namespace(namespace: str) -> str:
    if not _NAMESPACE_RE.fullmatch(namespace):
        raise ValueError(f"shm connector: namespace {namespace!r} must be 1-10 letters or digits")
    return namespace


def unlink_segment(name: str) -> bool:
    """Remove a segment by name, bypassing the resource tracker; False if it was already gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def sweep(namespace: str, tag: str = "") -> int:
    """Unlink every segment of `namespace` (of one connector's `tag` only, if given) left in
    /dev/shm (Linux); returns how many."""
    prefix = check_namespace(namespace) + "_" + (f"{tag}_" if tag else "")
    if not os.path.isdir(SHM_DIR):
        return 0
    return sum(unlink_segment(name) for name in os.listdir(SHM_DIR) if name.startswith(prefix))


def _open(name: str, size: int = 0) -> SharedMemory:
    """Create (size > 0) or attach to a segment, and take it away from the resource tracker."""
    shm = SharedMemory(name=name, create=size > 0, size=size)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _close(shm: SharedMemory) -> None:
    # BufferError: a tensor still views the mapping (only after an error mid-copy); the mapping
    # then goes away with that tensor, and the segment name is unlinked regardless.
    with contextlib.suppress(BufferError):
        shm.close()


class ShmConnector(Connector):
    kind = "shm"

    def __init__(self, namespace: str | None = None, inline_bytes: int = INLINE_BYTES,
                 tag: str | None = None) -> None:
        """tag: this instance's part of its segments' names (default: random), known in advance
        to whoever must sweep them after a crash."""
        super().__init__()
        self.namespace = check_namespace(new_namespace() if namespace is None else namespace)
        self.inline_bytes = inline_bytes       # 0: every payload gets a segment
        self.tag = secrets.token_hex(3) if tag is None else tag
        self.counter = itertools.count()
        # segments this instance created and has not seen consumed, per request id
        self.owned: dict[str, set[str]] = {}

    def segment_name(self, n: int) -> str:
        name = f"{self.namespace}_{self.tag}_{n:x}"
        assert len(name) <= MAX_NAME_LEN, (name, len(name))
        return name

    def put(self, key: ChunkKey, tensors: Mapping[str, Tensor]) -> TensorHandle:
        start = time.perf_counter()
        metas, nbytes = plan(tensors)
        if self.inline_bytes and nbytes <= self.inline_bytes:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            write(buf, tensors, metas)
            self.stats.add_put(nbytes, time.perf_counter() - start)
            return TensorHandle(key=key, kind=self.kind, tensors=metas, nbytes=nbytes,
                                data=buf.numpy().tobytes())
        while True:  # a clash needs another instance with the same random tag: retry, never reuse
            name = self.segment_name(next(self.counter))
            try:
                shm = _open(name, size=max(nbytes, 1))  # a segment cannot be empty
                break
            except FileExistsError:
                continue
        try:
            write(torch.frombuffer(shm.buf, dtype=torch.uint8)[:nbytes], tensors, metas)
        except BaseException:
            unlink_segment(name)
            raise
        finally:
            _close(shm)
        self.owned.setdefault(key.request_id, set()).add(name)
        self.stats.add_put(nbytes, time.perf_counter() - start)
        return TensorHandle(key=key, kind=self.kind, tensors=metas, location=name, nbytes=nbytes)

    def get(self, handle: TensorHandle,
            device: torch.device | str | None = None) -> dict[str, Tensor]:
        start = time.perf_counter()
        self.check_handle(handle)
        name = handle.location
        if not name:              # inline: the buffer came with the handle
            buf = (torch.frombuffer(bytearray(handle.data), dtype=torch.uint8) if handle.data
                   else torch.empty(0, dtype=torch.uint8))   # frombuffer refuses 0 bytes
            out = read(buf[:handle.nbytes], handle.tensors, device)
            self.stats.add_get(handle.nbytes, time.perf_counter() - start)
            return out
        try:
            shm = _open(name)
        except FileNotFoundError:
            raise KeyError(f"shm segment {name!r} for {handle.key} not found "
                           "(already consumed or released)") from None
        try:
            out = read(torch.frombuffer(shm.buf, dtype=torch.uint8)[:handle.nbytes],
                       handle.tensors, device)
        finally:
            _close(shm)
            unlink_segment(name)
        owned = self.owned.get(handle.key.request_id)
        if owned is not None:
            owned.discard(name)
        self.stats.add_get(handle.nbytes, time.perf_counter() - start)
        return out

    def release(self, request_id: str) -> int:
        """Unlink this producer's segments of `request_id` that no consumer has taken yet."""
        return sum(unlink_segment(name) for name in self.owned.pop(request_id, ()))

    def discard(self, handle: TensorHandle) -> None:
        """Unlink the chunk's segment (an inline chunk holds none)."""
        if handle.location:
            unlink_segment(handle.location)
            owned = self.owned.get(handle.key.request_id)
            if owned is not None:
                owned.discard(handle.location)

    def close(self) -> None:
        for request_id in list(self.owned):
            self.release(request_id)
