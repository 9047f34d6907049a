"""Connectors move tensors between stages, apart from the control messages that carry handles.

`inproc` (same process), `shm` (same host, POSIX shared memory), `tcp` (across hosts, zmq),
`auto` (shm or tcp per edge, by where its two ends run).
"""

from omnistage.connectors.base import (
    ChunkKey,
    Connector,
    ConnectorStats,
    TensorHandle,
    TensorMeta,
    make_connector,
)

__all__ = ["ChunkKey", "Connector", "ConnectorStats", "TensorHandle", "TensorMeta",
           "make_connector"]
