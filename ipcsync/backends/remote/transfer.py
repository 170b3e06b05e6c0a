"""A remote edge's transfer objects (``core.remote_session``; the I/O that drives them is
``runtime.remote.io``): the events that stand for a transfer, and the receive ring's memory.

On a remote edge an item's bytes move by one torch.distributed send (producer) and one
recv (consumer) per item. What the rest of ipcsync sees of that is the backend interface:

- ``SendEvent``: the producer's stand-in for a remote consumer's release event of one
  slot: complete when no send from that slot is pending (invariant 5), so ``runtime.producer.slots``
  orders an overwrite after the previous send as it orders it after a local reader;
- ``RecvEvent``: a remote item's ready event: the recv into its receive slot, and the
  producer's confirmation of its send (invariant 7);
- ``ReleaseEvent``: the consumer's release event (CUDA: a real event the next recv into
  the slot waits on);
- ``ReceiveArena`` and ``slot_tensors``: the receive ring on the consumer's device, one
  tensor per slot with a version counter of its own; ``staged``: the page-locked host
  buffers a gloo edge's CUDA end moves items through.

Transfer events are recorded only by their transfer: ``record()`` raises. The edge they
belong to is duck-typed (``timeout``, ``label``, ``broken``, ``watermark``, ``fail``).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from ...core.remote_session import READY_PLACEHOLDER, RELEASE_PLACEHOLDER
from ...errors import BackendError, IpcTimeoutError, PeerLostError
from ...interrupts import wait_point
from ..base import Arena, Event

__all__ = ["TransferEvent", "SendEvent", "RecvEvent", "ReleaseEvent", "ReceiveArena", "slot_tensors", "staged",
           "POLL_S"]

POLL_S = 0.0005  # how often a host wait on a transfer event looks again


def staged(buffers: dict[int, torch.Tensor], slot: int, capacity: int, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of the host memory a gloo edge's CUDA end stages ``slot``'s
    items through: ``capacity`` bytes, page-locked (so the copy to or from the GPU runs at
    full speed), made at the slot's first use."""
    buf = buffers.get(slot)
    if buf is None:
        buf = buffers[slot] = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
    return buf[:nbytes]


class TransferEvent(Event):
    """One slot's pending transfer on a remote edge, as an ``Event``: NCCL records a CUDA
    event on the edge's stream after the transfer; gloo counts the transfers posted into
    (or from) the slot and those the edge's completion thread (``runtime.remote.io``) saw
    finish. Recorded only by the transfer."""

    __slots__ = ("edge", "work", "cuda_event", "posted", "completed")
    _what, _by = "transfer", "transfer"  # for the error of record(): which event, recorded by what

    def __init__(self, edge: Any) -> None:
        self.edge = edge
        self.work: Any = None
        self.cuda_event: Any = None  # NCCL: recorded on the edge's stream after the transfer
        self.posted = 0  # gloo: transfers posted / completed (see the completion thread)
        self.completed = 0

    def record(self, stream: Any = None) -> None:
        raise BackendError(f"a remote edge's {self._what} event is recorded by its {self._by}")

    def in_flight(self) -> bool:
        """A transfer was posted and has not completed (gloo: by the completion thread's
        count; NCCL: by the CUDA event after it)."""
        if self.work is None:
            return False
        return self.completed != self.posted or (self.cuda_event is not None and not self.cuda_event.query())

    def wait(self, stream: Any = None) -> None:
        if self.cuda_event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self.cuda_event)
            return
        self.synchronize(self.edge.timeout)

    @wait_point
    def synchronize(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.query():
            if deadline is not None and time.monotonic() > deadline:
                self._timed_out(timeout)
            time.sleep(POLL_S)

    def _timed_out(self, timeout: float | None) -> None:
        raise NotImplementedError


class SendEvent(TransferEvent):
    """The producer's stand-in for a remote consumer's release event of one slot: the
    last send from that slot. Complete when no send is pending (invariant 5)."""

    __slots__ = ()
    _what, _by = "send", "send"

    def query(self) -> bool:
        w = self.work
        if w is None:
            return True
        # (Asked only while the consumer is in the peer table: a lost consumer's slots are
        # written again without waiting; it is never confirmed what they carry, invariant 7.)
        if self.cuda_event is not None:
            return bool(self.cuda_event.query())
        return self.completed == self.posted

    def _timed_out(self, timeout: float | None) -> None:
        raise IpcTimeoutError(f"a send to {self.edge.label} did not complete within {timeout} s")

    def handle(self) -> bytes:
        return RELEASE_PLACEHOLDER.encode()


class RecvEvent(TransferEvent):
    """A remote item's ready event (invariant 4): the recv into its receive slot of item
    ``seq``, and the producer's confirmation of its send."""

    __slots__ = ("seq",)

    def __init__(self, edge: Any) -> None:
        super().__init__(edge)
        self.seq = -1
    _what, _by = "ready", "recv"

    def query(self) -> bool:
        """Complete when the recv completed and the producer confirmed the item's send
        (invariant 7: a SENT covering ``seq``, which only the control channel's pump brings)."""
        w = self.work
        if w is None:
            return True
        edge = self.edge
        if edge.broken is not None:
            raise PeerLostError(f"remote edge from {edge.label} lost: {edge.broken}")
        # (gloo: the completion thread's count, a staged recv's copy included; NCCL posts
        # nothing to count: the CUDA event recorded after its recv says.)
        if self.completed != self.posted:
            return False
        if self.cuda_event is not None and not self.cuda_event.query():
            return False
        if not edge.watermark.covers(self.seq):
            return False
        self.work = None
        return True

    def _timed_out(self, timeout: float | None) -> None:
        self.edge.fail(f"no data within {timeout} s")
        raise PeerLostError(f"remote edge from {self.edge.label} lost: {self.edge.broken}")

    def handle(self) -> bytes:
        return READY_PLACEHOLDER.encode()


class ReleaseEvent(Event):
    """The consumer's release event on a remote edge: CPU reads are done when ``release()``
    is called; CUDA records a real event, which the next recv into the slot waits on."""

    __slots__ = ("cuda_event",)

    def __init__(self, device: torch.device) -> None:
        self.cuda_event = torch.cuda.Event() if device.type == "cuda" else None

    def record(self, stream: Any = None) -> None:
        if self.cuda_event is not None:
            self.cuda_event.record(stream)

    def wait(self, stream: Any = None) -> None:
        if self.cuda_event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self.cuda_event)

    def query(self) -> bool:
        return True if self.cuda_event is None else bool(self.cuda_event.query())

    def synchronize(self, timeout: float | None = None) -> None:
        if self.cuda_event is not None:
            self.cuda_event.synchronize()

    def handle(self) -> bytes:
        return RELEASE_PLACEHOLDER.encode()


class ReceiveArena(Arena):
    """The receive ring's memory: this process's own, on its device."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.handle = "receive-ring"
        self.nbytes = nbytes
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def close(self) -> None:
        pass  # freed with the last view; the edge keeps it while a recv may write it


def slot_tensors(base: torch.Tensor, slots: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
    """One tensor per slot ``(arena, offset, nbytes)`` on ``base``'s memory, each with a
    version counter of its own. A view shares its base's counter, and a write into the
    receive ring (the copy of a staged recv) bumps it: autograd then refused a held
    item's tensors, saved for backward, once the next item arrived in another slot
    ("modified by an inplace operation"). A slot is written only while no item in it is
    held, so its own counter moves only when it should."""
    storage = base.untyped_storage()
    return [torch.empty(0, dtype=torch.uint8, device=base.device).set_(storage, off, (n,), (1,)) for _a, off, n in slots]
