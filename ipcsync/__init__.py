"""ipcsync: zero-copy tensor handoff between PyTorch processes.

Producers own a ring of slots in shared memory (CUDA IPC memory on GPUs, POSIX shared
memory on the CPU backend); every handoff carries an event, so consumers wait on the GPU,
not the host; the control channel is ZeroMQ with msgpack messages, never pickle.

    with ipcsync.Producer("frames", slots=4) as out:
        out.send({"x": x}, meta={"step": i})

    with ipcsync.Consumer("frames") as inp:
        for item in inp:
            use(item["x"], item.meta)
"""

from __future__ import annotations

from .backends.cuda import IpcEvent, export_tensor, import_tensor
from .channel import CurveKeys
from .consumer import Consumer, Item
from .errors import (
    BackendError,
    ClosedError,
    ConfigError,
    IpcSyncError,
    IpcTimeoutError,
    PeerLostError,
    ProducerFailedError,
    ProtocolError,
)
from .fanin import FanIn
from .forward import forward
from .producer import Producer, SlotWriter
from .protocol import PROTOCOL_VERSION

__version__ = "0.1.0"

__all__ = [
    "Producer",
    "Consumer",
    "Item",
    "FanIn",
    "forward",
    "CurveKeys",
    "SlotWriter",
    "IpcEvent",
    "export_tensor",
    "import_tensor",
    "IpcSyncError",
    "ProtocolError",
    "PeerLostError",
    "ProducerFailedError",
    "ClosedError",
    "IpcTimeoutError",
    "ConfigError",
    "BackendError",
    "PROTOCOL_VERSION",
    "__version__",
]
