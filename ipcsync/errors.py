"""The one exception tree of ipcsync.

Every error raised by ipcsync derives from :class:`IpcSyncError`. The split follows trio:
"you closed it" (:class:`ClosedError`) is a different error from "the peer broke it"
(:class:`PeerLostError`). Each message says what happened and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "IpcSyncError",
    "ProtocolError",
    "PeerLostError",
    "ProducerFailedError",
    "ClosedError",
    "IpcTimeoutError",
    "ConfigError",
    "BackendError",
    "ItemWrittenError",
    "SlotKeptError",
]


class IpcSyncError(Exception):
    """Base class of every error raised by ipcsync."""


class ProtocolError(IpcSyncError):
    """A frame or message broke the wire protocol (malformed, oversized, wrong version,
    out of order). The offending frame is dropped; nothing it described is used."""


class PeerLostError(IpcSyncError):
    """The peer process went away: it died, or closed its connection without goodbye.
    (Silence alone never means lost while the peer's process lives: a paused peer is
    waited for.) Items it had not yet delivered are gone; restart or reconnect."""


class ProducerFailedError(PeerLostError):
    """The producer ended its stream as failed: its ``with`` block exited by an exception
    (Ctrl-C included) or it called ``abort()``. The message carries the producer's
    exception type and text. Never a clean end of the stream: items it had sent but that
    were not yet received are dropped."""


class ClosedError(IpcSyncError):
    """This endpoint was closed by its own process; it cannot be used any more."""


class IpcTimeoutError(IpcSyncError, TimeoutError):
    """A blocking call did not complete within its timeout. Nothing was lost: the call
    can be retried. Also a builtin :class:`TimeoutError`."""


class ConfigError(IpcSyncError, ValueError):
    """An option, endpoint, message or device is not acceptable (bad name, a message
    larger than a slot, an endpoint already bound by a live producer, ...)."""


class BackendError(IpcSyncError):
    """The memory/event backend failed (shared memory or CUDA IPC could not be created,
    opened or used)."""


class ItemWrittenError(IpcSyncError):
    """A received item changed while this consumer held it (``verify=True``): an in-place
    op on a received tensor (``x.mul_()``, ``x.div_()``, ...) wrote into the producer's
    slot, which other readers of a broadcast edge and forwarded copies share. The item
    was released; clone() a received tensor before changing it."""


class SlotKeptError(IpcSyncError):
    """A ``Producer.slot()`` block ended while a tensor taken from it is still referenced:
    a write through it would change the item after it was sent, so it was not sent. Its
    slot is reused once that tensor is gone; keep no reference to ``s[name]`` past the
    block (``del`` it, or copy into it without naming it)."""
