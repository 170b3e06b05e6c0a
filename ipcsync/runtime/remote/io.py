"""Remote edges: the I/O of ``core.remote_session`` (read its invariants first).

A producer and a consumer on different hosts keep the ZeroMQ control channel (tcp://,
CURVE) and move each item's bytes with torch.distributed point-to-point: gloo for CPU
tensors, NCCL for CUDA tensors, through the same code. Each edge (one producer, one
consumer connection) has its own two-rank process group built directly on a
``SealedStore`` over a c10d ``TCPStore`` that the producer serves: no
``init_process_group``, so a user's default process group is never touched, and no
``*_object_list`` (no pickle).

- Producer: ``RemoteHub`` (the store, made at the first remote HELLO, on the endpoint's
  address) makes a ``ProducerEdge`` per remote consumer (rank 0), at most
  ``MAX_PENDING_JOINS`` of them joining at once. Its ``send(slot, layout)`` posts one send
  of the item's extent, tag = slot; ``release_events`` (one ``SendEvent`` per slot) stand
  for the consumer's release events, so ``runtime.producer.slots`` orders an overwrite after the
  previous send as it orders it after a local reader.
- Consumer: ``open_consumer_edge`` (rank 1) makes the receive ring (``ConsumerEdge``) on the
  consumer's device, fills the link's ``RingMemory`` with its views and events, and
  ``post`` posts the recv of each buffered READY; ``RecvEvent`` is the item's ready event.
- Loss: ``RemoteWatch`` makes silence for ``LOSS_HEARTBEATS`` heartbeats loss; on loss the
  edge is aborted (``ProcessGroup.abort``/``shutdown`` where this torch has them) and its
  pending work abandoned, never waited for.

The events and the receive ring's memory the edges hand to the rest of ipcsync
(``SendEvent``, ``RecvEvent``, ``ReleaseEvent``, ``ReceiveArena``) are backend objects:
``ipcsync.backends.remote``. The modules below keep the I/O: the groups, the transfers
and the threads that post and complete them.

Security: the control channel is CURVE (with the producer's client allow-list); the
edge's rendezvous goes through the producer's store sealed with the edge's secret
(``sealed_store``), which only the SETUP carries; torch.distributed's data connections
are neither authenticated nor encrypted (as under torchrun). See docs/remote.md.

The modules, one job each (every name below is importable from here too):
``runtime.remote.groups`` (transport, time limit, making and ending a group),
``runtime.remote.completer`` (the completion threads; ``settle_at_exit``),
``runtime.remote.producer`` (``RemoteHub``, ``ProducerEdge``),
``runtime.remote.consumer`` (``ConsumerEdge``, ``open_consumer_edge``); this module
keeps ``RemoteWatch``, the loss rule's watch of a remote peer.
"""

from __future__ import annotations

import time
from typing import Any

from ...core.remote_session import LOSS_HEARTBEATS, silence_is_loss
from .completer import settle_at_exit
from .consumer import ConsumerEdge, open_consumer_edge
from .groups import OP_TIMEOUT_ENV, TRANSPORT_ENV, op_timeout, transport_for
from .producer import MAX_PENDING_JOINS, BusyError, ProducerEdge, RemoteHub

__all__ = ["RemoteHub", "BusyError", "MAX_PENDING_JOINS", "ProducerEdge", "ConsumerEdge", "RemoteWatch",
           "open_consumer_edge", "transport_for", "TRANSPORT_ENV", "OP_TIMEOUT_ENV", "op_timeout",
           "settle_at_exit"]


class RemoteWatch:
    """``ProcessWatch``'s place for a remote peer: no process to watch on another host, so
    silence is loss (invariant 6), as is a failed transfer on its edge. Silence counts
    only once the peer ``joined`` the edge: a consumer joining it (NCCL's communicator,
    seconds on a busy machine) cannot speak meanwhile, holds nothing yet, and is bounded
    by the handshake limit instead (HELLO to ATTACH)."""

    def __init__(self, clock: Any, edge: "ProducerEdge | ConsumerEdge | None" = None, *,
                 joined: bool = True) -> None:
        self.clock = clock
        self.edge = edge
        self.joined = joined  # the producer's watch of a consumer: set at its ATTACH

    def gone(self) -> bool:
        edge = self.edge
        if edge is not None and edge.broken is not None:
            return True
        if not self.joined:
            return False
        clock = self.clock
        return silence_is_loss(clock.silent_for(time.monotonic()), clock.heartbeat)

    def why(self) -> str:
        """Why ``gone()`` said so, as the end of a sentence about the peer."""
        edge = self.edge
        if edge is not None and edge.broken is not None:
            return f"lost its remote edge ({edge.broken})"
        clock = self.clock
        return (f"was silent for {clock.silent_for(time.monotonic()):.1f} s, past {LOSS_HEARTBEATS} heartbeats of "
                f"{clock.heartbeat:.2f} s (a peer on another host is lost when silent)")

    def close(self) -> None:
        self.edge = None
