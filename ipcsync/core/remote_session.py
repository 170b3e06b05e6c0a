"""The rules of a remote edge, sans I/O: a producer and a consumer on different hosts,
whose data travels by torch.distributed point-to-point instead of shared memory or CUDA IPC
(the I/O is ``ipcsync.runtime.remote.io``).

Invariants (each stated once, here):

1. **Who is remote.** A consumer is remote when its HELLO's host identity (the ``boot_id``
   field, see ``system.host.host_identity``) differs from the producer's, and the
   endpoint is ``tcp://``. On an ipc endpoint a different host identity is refused, as
   before (``ErrorCode.HOST``). The decision is made once, at HELLO; the local path is
   untouched by it.
2. **The wire is unchanged.** A remote SETUP carries, in the fields a local SETUP uses for
   memory handles: ``arenas = [edge address]`` (``EdgeAddress``, a text handle starting with
   ``ADDRESS_PREFIX``), ``arena_bytes = [the producer's ring size]``, the producer's slot
   table, and ``READY_PLACEHOLDER`` per slot as ready events; the consumer's ATTACH carries
   ``RELEASE_PLACEHOLDER`` per slot. Meta and layouts travel in READY frames (msgpack),
   never through torch.distributed; nothing is pickled.
3. **Receive ring.** The consumer holds a ring of the producer's geometry on its own device
   (slot ``s`` at the offset SETUP gives for ``s``). Item ``(seq, slot s)`` is received into
   receive slot ``s``: exactly ``extent`` bytes (``layout_extent``: from the slot's start to
   the end of the farthest tensor, the same number ``Recipe.extent`` gives), one send and
   one recv per item, tag ``s``. At most one transfer per slot is outstanding, because the
   producer reuses slot ``s`` only after the consumer released it (5.).
4. **Ready.** The consumer's item is ready when its recv has completed (CUDA: an event
   recorded on the consumer's stream after the recv) *and* the producer confirmed its send
   (7.). The recv of an item is posted when its READY is buffered, in seq order
   (``RecvLedger``).
5. **Release.** A remote consumer's RELEASE of ``(seq, s, gen)`` means "receive slot ``s`` is
   free again and I read nothing more of it". The producer's slot ``s`` is freed by it (the
   ring's rule: every holder released), and before slot ``s`` is written again the
   producer's send of the previous item in ``s`` has completed (the peer's release event
   for ``s`` *is* that send: ``order_after_readers`` waits on it as on any release event).
   So backpressure is the consumer's receive ring: a consumer holding all its receive
   slots blocks the producer.
6. **Loss.** No memory is shared, so nothing can be corrupted by a dead peer: its
   connection closing or its silence for ``LOSS_HEARTBEATS`` heartbeats is loss
   (``silence_is_loss``). On loss every torch.distributed operation pending with it is
   abandoned and its process group aborted; no wait on it outlives ``op_timeout``.
7. **Confirmation.** A completed recv alone does not make an item's bytes the item's: a
   dropped consumer's send may still be running when the producer writes its slot again,
   and gloo/NCCL say nothing reliable about what an aborted transfer read. So the
   producer confirms each completed send over the control channel, cumulatively
   (``SENT{seq}``: every send to this consumer of an item up to ``seq`` has completed),
   and a consumer serves an item with bytes only once its recv completed *and* a SENT
   covers its seq. The producer confirms only sends it saw complete (``Work.wait()`` true,
   or the CUDA event after the send) while the edge was whole, and stops confirming
   before it aborts the edge, forgets the consumer or writes any slot the consumer had a
   send pending on (``SendLedger.close``): when it drops a consumer it queues ERROR
   ``dropped`` first. A confirmed send read its slot before any rewrite, so a served item
   holds its own bytes, by construction and whatever an abort does. A consumer whose
   confirmation never comes (dropped, the ERROR lost to a full queue, the producer
   paused) never serves the item: its liveness rule (6.) or its timeout ends the wait
   with an error. SENT moves strictly forward and never past the newest READY
   (``SentWatermark``: else ProtocolError). Items with nothing to transfer need none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import ProtocolError
from .layout import dtype_from_name, span_elements

__all__ = ["ADDRESS_PREFIX", "READY_PLACEHOLDER", "RELEASE_PLACEHOLDER", "LOSS_HEARTBEATS", "TRANSPORTS",
           "EdgeAddress", "is_remote_handle", "layout_extent", "silence_is_loss", "RecvLedger", "SendLedger",
           "SentWatermark"]

ADDRESS_PREFIX = "ipcsync-remote/1 "
READY_PLACEHOLDER = "remote"
RELEASE_PLACEHOLDER = "remote"
# A remote peer silent for this many of its heartbeats is lost (locally, silence is only
# "stalled": there a live process may still read shared memory; here none can).
LOSS_HEARTBEATS = 3.0
TRANSPORTS = ("gloo", "nccl")

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HOST = re.compile(r"^[A-Za-z0-9_.:%-]{1,253}$")


@dataclass(frozen=True)
class EdgeAddress:
    """Where a remote edge's process group meets: the producer's c10d TCPStore
    (``host``:``port``), the edge's secret (``edge``, unique per connection, sent only in
    the SETUP: the store's names and values are sealed with it, core.seal), the
    transport, and the producer's data address for gloo (``data_host``)."""

    transport: str
    host: str
    port: int
    edge: str
    data_host: str

    def encode(self) -> str:
        return f"{ADDRESS_PREFIX}{self.transport} {self.host} {self.port} {self.edge} {self.data_host}"

    @classmethod
    def parse(cls, handle: Any) -> "EdgeAddress":
        """ProtocolError for anything but what ``encode`` makes (a peer's word is checked
        before any connection is made to what it names)."""
        if type(handle) is not str or not handle.startswith(ADDRESS_PREFIX):
            raise ProtocolError("not a remote edge address")
        parts = handle[len(ADDRESS_PREFIX):].split(" ")
        if len(parts) != 5:
            raise ProtocolError("a remote edge address has 5 fields: transport host port edge data_host")
        transport, host, port, edge, data_host = parts
        if transport not in TRANSPORTS:
            raise ProtocolError(f"remote edge transport must be one of {TRANSPORTS}, got {transport[:16]!r}")
        if not _HOST.match(host) or not _HOST.match(data_host):
            raise ProtocolError("remote edge host is not a host name or address")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ProtocolError("remote edge port must be 1..65535")
        if not _TOKEN.match(edge):
            raise ProtocolError("remote edge key must be 1-64 characters [A-Za-z0-9_-]")
        return cls(transport, host, int(port), edge, data_host)


def is_remote_handle(handle: Any) -> bool:
    """Whether a SETUP arena handle names a remote edge (invariant 2)."""
    return type(handle) is str and handle.startswith(ADDRESS_PREFIX)


def layout_extent(layout: Sequence[Any]) -> int:
    """Bytes from a slot's start to the end of the farthest tensor of a (validated) layout:
    what one item's send and recv carry (invariant 3). Equal to ``Recipe(layout).extent``."""
    end = 0
    for name, shape, stride, offset in layout[1]:
        # (an empty tensor reaches its offset, as Recipe counts it)
        end = max(end, offset + span_elements(shape, stride) * dtype_from_name(name).itemsize)
    return end


def silence_is_loss(silent_for: float, heartbeat: float) -> bool:
    """Invariant 6: silence past LOSS_HEARTBEATS heartbeats is loss (never with heartbeats
    off: then only the connection's close says so)."""
    return heartbeat > 0 and silent_for > LOSS_HEARTBEATS * heartbeat


class RecvLedger:
    """The consumer's side of invariant 4: which buffered READY entries already have their
    recv posted. Entries are buffered in seq order and taken from the front, so the
    entries not yet posted are always a suffix of the buffer: ``to_post`` walks back from
    the end to the newest posted seq."""

    __slots__ = ("posted_seq",)

    def __init__(self) -> None:
        self.posted_seq = -1  # the newest seq whose recv is posted

    def to_post(self, ready: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The entries of ``ready`` (``(seq, slot, ...)``, seq increasing) to post now, in
        order; records them as posted."""
        out: list[tuple[Any, ...]] = []
        last = self.posted_seq
        for entry in reversed(ready):
            if entry[0] <= last:
                break
            out.append(entry)
        if out:
            out.reverse()
            self.posted_seq = out[-1][0]
        return out


class SendLedger:
    """The producer's side of invariant 7, for one edge: the newest seq whose send (and
    every earlier one: sends complete in the order posted) completed while the edge was
    whole (``done``, written by the thread that sees completions), and the newest seq
    already confirmed (``told``, by the thread that sends frames). Once ``close`` is called
    nothing more is recorded or confirmed."""

    __slots__ = ("done", "told", "open")

    def __init__(self) -> None:
        self.done = -1
        self.told = -1
        self.open = True

    def completed(self, seq: int) -> bool:
        """The send of item ``seq`` completed (it was not aborted). False once closed:
        then it is never confirmed."""
        if not self.open:
            return False
        if seq > self.done:
            self.done = seq
        return True

    def to_confirm(self) -> int | None:
        """The seq the next SENT carries, or None when there is nothing new to confirm (or
        the ledger is closed); records it as told."""
        if not self.open or self.done <= self.told:
            return None
        self.told = self.done
        return self.told

    def close(self) -> None:
        """No confirmation from now on: called before the edge is aborted, the consumer
        forgotten, or any of its slots written again."""
        self.open = False


class SentWatermark:
    """The consumer's side of invariant 7: the newest seq the producer confirmed."""

    __slots__ = ("confirmed",)

    def __init__(self) -> None:
        self.confirmed = -1

    def on_sent(self, seq: int, announced: int) -> None:
        """A SENT for ``seq``; ``announced``: the newest seq a READY named so far.
        ProtocolError for a SENT that does not move forward, or confirms an item never
        announced."""
        if seq <= self.confirmed:
            raise ProtocolError(f"SENT {seq} after SENT {self.confirmed}: confirmations only move forward")
        if seq > announced:
            raise ProtocolError(f"SENT confirms item {seq}, but the newest READY named item {announced}")
        self.confirmed = seq

    def covers(self, seq: int) -> bool:
        return seq <= self.confirmed
