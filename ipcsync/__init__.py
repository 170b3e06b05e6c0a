"""ipcsync: zero-copy tensor handoff between PyTorch processes.

Producers own a ring of slots in shared memory (CUDA IPC memory on GPUs, POSIX shared
memory on the CPU backend); every handoff carries an event, so consumers wait on the GPU,
not the host; the control channel is ZeroMQ with msgpack messages, never pickle.

    with ipcsync.Producer("frames", slots=4) as out:
        out.send({"x": x}, meta={"step": i})

    with ipcsync.Consumer("frames") as inp:
        for item in inp:
            use(item["x"], item.meta)

Importing ``ipcsync`` is cheap: the public names load their modules (torch, zmq) on first
use (PEP 562), so ``ipcsync.__version__`` and the launcher's command line load neither.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    BackendError,
    ClosedError,
    ConfigError,
    IpcSyncError,
    IpcTimeoutError,
    ItemWrittenError,
    PeerLostError,
    ProducerFailedError,
    ProtocolError,
    SlotKeptError,
)

if TYPE_CHECKING:  # the real imports, for type checkers; at run time see __getattr__
    from .backends.cuda import IpcEvent, export_tensor, import_tensor
    from .runtime.transport.channel import CurveKeys
    from .consumer import Consumer
    from .item import Item, SlotWriter
    from .fanin import FanIn
    from .forwarding import forward
    from .producer import Producer
    from .core.protocol import PROTOCOL_VERSION, Limits
    from .core.stats_types import ConsumerStats, FanInStats, Latency, Occupancy, ProducerStats

__version__ = "0.1.0"

__all__ = [
    # endpoints and what they hand out
    "Producer", "Consumer", "Item", "FanIn", "forward", "CurveKeys", "SlotWriter",
    # what their stats() return
    "ProducerStats", "ConsumerStats", "FanInStats", "Latency", "Occupancy",
    # the low-level layer
    "IpcEvent", "export_tensor", "import_tensor",
    # the one exception tree (ipcsync.errors)
    "IpcSyncError", "ProtocolError", "PeerLostError", "ProducerFailedError", "ClosedError",
    "IpcTimeoutError", "ConfigError", "BackendError", "ItemWrittenError", "SlotKeptError",
    "PROTOCOL_VERSION", "Limits", "__version__",
]

# public name -> the submodule that defines it (loaded on first access)
_LAZY = {
    "IpcEvent": ".backends.cuda",
    "export_tensor": ".backends.cuda",
    "import_tensor": ".backends.cuda",
    "CurveKeys": ".runtime.transport.channel",
    "Consumer": ".consumer",
    "Item": ".item",
    "FanIn": ".fanin",
    "forward": ".forwarding",  # (a module of another name: a submodule ``forward``, once
    #                             imported, would replace the function as a package attribute)
    "Producer": ".producer",
    "SlotWriter": ".item",
    "PROTOCOL_VERSION": ".core.protocol",
    "Limits": ".core.protocol",
    "ProducerStats": ".core.stats_types",
    "ConsumerStats": ".core.stats_types",
    "FanInStats": ".core.stats_types",
    "Latency": ".core.stats_types",
    "Occupancy": ".core.stats_types",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
