"""TcpConnector: stages on different hosts; chunks are pushed straight to the consumer over zmq.

Addressing is by edge. A consumer binds one PULL socket (`listen`, port 0 = any free port) and
advertises `address`; a producer knows, per edge it feeds, the address of the stage on the other
end (`peers`, or `add_peer` once the consumer has bound), and `put` pushes to `peers[key.edge]`.
A stage in the middle of a graph does both with one instance:

    thinker                      talker                            code2wav
    TcpConnector(peers={         TcpConnector(                     TcpConnector(
      "thinker->talker": A})       listen="tcp://10.0.0.2:0", # A    listen="tcp://10.0.0.3:0")  # B
                                   peers={"talker->code2wav": B})
    put(ChunkKey(r, "thinker->talker", i)) --PUSH--> PULL at A
                                 put(ChunkKey(r, "talker->code2wav", j)) --PUSH--> PULL at B

The handle still travels through the orchestrator; the data does not. Wire format, one zmq
multipart message per chunk: [msgpack(TensorHandle), raw packed bytes (see `packing.py`)], the
bytes sent without a copy. `get(handle)` waits up to `timeout_s` for that key, buffering chunks of
other keys that arrive first. Not thread-safe: one instance belongs to one stage loop.
"""

from __future__ import annotations

import math
import re
import time
from collections import OrderedDict
from collections.abc import Mapping

import msgspec
import torch
import zmq
from torch import Tensor

from omnistage.connectors.base import ChunkKey, Connector, TensorHandle
from omnistage.connectors.packing import pack, read

_LISTEN_RE = re.compile(r"tcp://(?P<host>.+):(?P<port>\d+)")
MAX_RELEASED = 4096  # request ids (and discarded chunks) remembered so that chunks arriving
                    # after release are dropped


class TcpConnector(Connector):
    kind = "tcp"

    def __init__(self, listen: str | None = None, peers: Mapping[str, str] | None = None,
                 timeout_s: float = 30.0) -> None:
        """listen: "tcp://HOST:PORT" to bind for receiving (PORT 0: a free port; bind a concrete
        interface address when other hosts must reach it); None for a producer-only connector.
        peers: edge name -> consumer address, where `put` sends chunks of that edge."""
        super().__init__()
        match = None if listen is None else _LISTEN_RE.fullmatch(listen)
        if listen is not None and match is None:
            raise ValueError(f"tcp connector: listen {listen!r} must look like tcp://HOST:PORT")
        self.timeout_s = timeout_s
        self.peers: dict[str, str] = dict(peers or {})
        self.ctx = zmq.Context()
        self.push: dict[str, zmq.Socket] = {}            # address -> PUSH socket, made on first use
        self.pull: zmq.Socket | None = None
        self._address: str | None = None
        self.arrived: dict[ChunkKey, tuple[TensorHandle, zmq.Frame]] = {}
        self.released: OrderedDict[str, None] = OrderedDict()
        self.discarded: OrderedDict[ChunkKey, None] = OrderedDict()
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(TensorHandle)
        if match is not None:
            try:
                self.pull, self._address = self._bind(match["host"], int(match["port"]))
            except zmq.ZMQError:
                self.close()
                raise

    def _bind(self, host: str, port: int) -> tuple[zmq.Socket, str]:
        sock = self.ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if port == 0:
                sock.bind_to_random_port(f"tcp://{host}")
            else:
                sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError:
            sock.close()
            raise
        return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def address(self) -> str:
        """The bound endpoint, e.g. "tcp://127.0.0.1:50123"; producers put it in `peers`."""
        if self._address is None:
            raise ValueError("tcp connector: no listen address (this instance only sends)")
        return self._address

    @property
    def num_buffered(self) -> int:
        """Chunks received and not yet taken by `get`."""
        return len(self.arrived)

    def add_peer(self, edge: str, address: str) -> None:
        self.peers[edge] = address

    def set_peers(self, peers: Mapping[str, str]) -> None:
        """Replace every peer: the whole table, as it stands after a replica (re)started."""
        self.peers = dict(peers)

    def put(self, key: ChunkKey, tensors: Mapping[str, Tensor]) -> TensorHandle:
        start = time.perf_counter()
        dest = self.peers.get(key.edge)
        if dest is None:
            raise ValueError(f"tcp connector: no peer address for edge {key.edge!r} "
                             f"(known edges: {sorted(self.peers)})")
        metas, buf = pack(tensors)
        handle = TensorHandle(key=key, kind=self.kind, tensors=metas, location=dest,
                              nbytes=buf.numel())
        self._socket_to(dest).send_multipart([self.encoder.encode(handle), buf.numpy()],
                                             copy=False)
        self.stats.add_put(handle.nbytes, time.perf_counter() - start)
        return handle

    def _socket_to(self, address: str) -> zmq.Socket:
        sock = self.push.get(address)
        if sock is None:
            sock = self.push[address] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        return sock

    def get(self, handle: TensorHandle, device: torch.device | str | None = None,
            timeout_s: float | None = None) -> dict[str, Tensor]:
        start = time.perf_counter()
        self.check_handle(handle)
        self._wait_for(handle.key, self.timeout_s if timeout_s is None else timeout_s)
        sent, frame = self.arrived.pop(handle.key)
        assert sent.tensors == handle.tensors and len(frame) == sent.nbytes, (
            handle.key, sent.nbytes, len(frame))
        buf = torch.frombuffer(frame.buffer, dtype=torch.uint8) if sent.nbytes else \
            torch.empty(0, dtype=torch.uint8)
        out = read(buf, sent.tensors, device)
        self.stats.add_get(sent.nbytes, time.perf_counter() - start)
        return out

    def _wait_for(self, key: ChunkKey, timeout_s: float) -> None:
        pull = self.pull
        if pull is None:
            raise ValueError(f"tcp connector: cannot get {key}: no listen address")
        deadline = time.monotonic() + timeout_s
        self._drain()
        while key not in self.arrived:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not pull.poll(math.ceil(remaining * 1000)):
                raise TimeoutError(f"tcp connector: chunk {key} did not arrive at {self.address} "
                                   f"within {timeout_s} s")
            self._drain()

    def _drain(self) -> None:
        """Move every message waiting on the PULL socket into `arrived`, without blocking."""
        assert self.pull is not None
        while True:
            try:
                header, frame = self.pull.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle = self.decoder.decode(header.buffer)
            if handle.key in self.discarded:
                del self.discarded[handle.key]
            elif handle.key.request_id not in self.released:
                self.arrived[handle.key] = (handle, frame)

    def release(self, request_id: str) -> int:
        """Drop received chunks of `request_id`, and any that arrive for it later."""
        if self.pull is None:
            return 0  # a producer-only instance holds nothing: sent chunks live at the consumer
        self._drain()
        self.released[request_id] = None
        if len(self.released) > MAX_RELEASED:
            self.released.popitem(last=False)
        keys = [key for key in self.arrived if key.request_id == request_id]
        for key in keys:
            del self.arrived[key]
        return len(keys)

    def discard(self, handle: TensorHandle) -> None:
        """Drop the chunk if it arrived, else when it arrives."""
        if self.pull is None:
            return
        self._drain()
        if self.arrived.pop(handle.key, None) is None:
            self.discarded[handle.key] = None
            if len(self.discarded) > MAX_RELEASED:
                self.discarded.popitem(last=False)

    def close(self) -> None:
        self.arrived.clear()
        for sock in [*self.push.values(), *([self.pull] if self.pull is not None else [])]:
            sock.close(linger=0)
        self.push.clear()
        self.pull = None
        if not self.ctx.closed:
            self.ctx.term()
