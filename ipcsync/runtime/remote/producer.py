"""The producer's side of remote edges: its rendezvous (``RemoteHub``: the store, at
most ``MAX_PENDING_JOINS`` joins at once) and one ``ProducerEdge`` per remote consumer
(rank 0: its group, built in a thread, and the send of each item). Read
``runtime.remote.io`` first."""

from __future__ import annotations

import logging
import os
import socket
import threading
from functools import partial
from typing import Any, Callable, Sequence

import torch

from ...backends import Event
from ...backends.remote import SendEvent, staged
from ...core.remote_session import EdgeAddress, SendLedger, layout_extent
from ...envopts import REMOTE_ADDR
from ..transport.address import Endpoint
from .completer import CLOSE_JOIN_S, LOST_JOIN_S, Completer, edge_ids
from .groups import make_group, nccl_transfer, op_timeout, shut_down_or_abort, tcp_host, transport_for
from .sealed_store import SealedStore, serve_store

__all__ = ["RemoteHub", "BusyError", "MAX_PENDING_JOINS", "ProducerEdge"]

log = logging.getLogger(__name__)

# Remote consumers joining a producer at once (SETUP sent, no ATTACH yet); more are
# refused until one attaches or is dropped (a HELLO flood costs at most this many joins).
MAX_PENDING_JOINS = 16


class RemoteHub:
    """The producer's rendezvous for its remote edges: one c10d TCPStore (made at the
    first remote HELLO, on an ephemeral port of the endpoint's address and no other) and,
    per edge, a ``SealedStore`` on it under the edge's own secret (sent only in the
    SETUP, inside the CURVE-encrypted channel). At most ``MAX_PENDING_JOINS`` edges are
    joining (SETUP sent, no ATTACH yet) at once: a flood of HELLOs that never ATTACH is
    refused past that, and each dropped join frees its thread and half-made group at once
    (``ProducerEdge.drop``)."""

    def __init__(self, endpoint: Endpoint, device: torch.device, slot_views: Sequence[torch.Tensor],
                 ready_events: Sequence[Event], name: str) -> None:
        self.host, self.port = tcp_host(endpoint)
        self.device = device
        self.slot_views = slot_views
        self.ready_events = ready_events
        self.name = name
        self.store: Any = None
        self.edges: list[ProducerEdge] = []
        self.timeout = op_timeout()
        # Called by an edge's completion thread when its ledger has a send to confirm, with
        # a callable saying whether that thread was told to stop (runtime.producer.port sends the
        # SENT frames under the producer's lock); None: they go out at the next pump.
        self.on_sent: Callable[[Callable[[], bool]], None] | None = None

    def advertised_host(self) -> str:
        """The address consumers reach this producer at: the endpoint's host, or for a
        wildcard bind ``$IPCSYNC_REMOTE_ADDR`` (else this host's name)."""
        if self.host in ("*", "0.0.0.0", "::", ""):
            return REMOTE_ADDR.get() or socket.getfqdn()
        return self.host

    def pending_joins(self) -> int:
        """Edges whose consumer has not attached yet (and not been dropped)."""
        return sum(1 for e in self.edges if e.joining())

    def new_edge(self, label: str, consumer_backend: str) -> "ProducerEdge":
        """The edge to a consumer whose device is of kind ``consumer_backend``.
        ``BusyError`` when MAX_PENDING_JOINS edges are joining already."""
        self.edges = [e for e in self.edges if not e.closed]
        if self.pending_joins() >= MAX_PENDING_JOINS:
            raise BusyError(f"{MAX_PENDING_JOINS} remote consumers are joining already (none has attached "
                            "yet); retry in a moment")
        transport = transport_for(self.device, consumer_backend)
        host = self.advertised_host()
        if self.store is None:
            self.store = serve_store(host, 0, self.timeout)
        key = os.urandom(32).hex()  # the edge's secret: only in the (encrypted) SETUP
        addr = EdgeAddress(transport, host, int(self.store.port), key, host)
        edge = ProducerEdge(self, addr, label)
        self.edges.append(edge)
        return edge

    def close(self) -> None:
        for edge in self.edges:
            edge.close()
        self.edges = []
        self.store = None


class BusyError(RuntimeError):
    """Too many remote consumers are joining at once (``MAX_PENDING_JOINS``)."""


class ProducerEdge:
    """Rank 0 of one remote edge. The group is built in a thread (its rendezvous waits
    for the consumer), ``attach`` waits for it; ``send`` posts one item's transfer. The
    completion threads start at ``attach``: a join that never attaches costs one thread,
    ended by ``drop``."""

    def __init__(self, hub: RemoteHub, addr: EdgeAddress, label: str) -> None:
        self.hub = hub
        self.address = addr
        self.label = label
        self.timeout = hub.timeout
        self.pg: Any = None
        self.broken: str | None = None
        self.closed = False
        self.attached = False
        self.ledger = SendLedger()  # invariant 7: the sends completed and confirmed
        self.release_events = [SendEvent(self) for _ in hub.slot_views]
        self.stream: Any = None
        self.staging: dict[int, torch.Tensor] | None = None
        self.completer: Completer | None = None
        self.store = SealedStore(hub.store, addr.edge.encode(), self.timeout)
        self._built = threading.Lock()  # `pg` is set only while the edge is not closed
        self._thread = threading.Thread(target=self._build, args=(self.store,), daemon=True,
                                        name=f"ipcsync-remote-{next(edge_ids)}")
        self._thread.start()

    def joining(self) -> bool:
        return not self.attached and not self.closed

    def _build(self, store: Any) -> None:
        try:
            pg = make_group(self.address.transport, store, 0, self.hub.device, self.address.data_host,
                             self.timeout)
        except Exception as exc:  # noqa: BLE001 (reported through `broken`)
            self.broken = f"rendezvous failed: {exc}"
            return
        with self._built:
            if not self.closed:
                self.pg = pg
                return
        shut_down_or_abort(pg, False, keep=None)  # dropped while its group was made

    def attach(self, timeout: float) -> str | None:
        """Wait (bounded) for the group: None when it is up, else why not. The consumer
        sends ATTACH only after its own rank joined, so this is a short wait."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return f"the remote edge's rendezvous did not complete within {timeout} s"
        if self.broken is None:
            self.attached = True
            if self.hub.device.type == "cuda":
                self.stream = torch.cuda.Stream(self.hub.device)
            # gloo from a CUDA producer: per slot, pinned host memory its items are copied to
            # before their send (made at the slot's first send). Reused only after the slot's
            # previous send completed: the ring writes the slot again only then (invariant 5).
            self.staging = {} if self.address.transport == "gloo" and self.stream is not None else None
            self.completer = Completer(self, f"ipcsync-send-{next(edge_ids)}",
                                        sum(v.numel() for v in self.hub.slot_views))
        return self.broken

    def sent(self, completer: Completer) -> None:
        """(The completion thread) a send completed: have it confirmed (invariant 7)."""
        on_sent = self.hub.on_sent
        if on_sent is not None:
            on_sent(lambda: completer.stopped)

    def send(self, slot: int, layout: Any, seq: int) -> None:
        """Post the send of item ``seq`` in ``slot`` (invariant 3). Its ready event was
        recorded before READY was queued; NCCL's stream is made to wait on it. The send is
        confirmed once it completed (invariant 7)."""
        if self.broken is not None or self.pg is None or self.completer is None:
            return  # lost: the ring reclaims its slots; nothing to send to
        nbytes = layout_extent(layout)
        if nbytes == 0:
            return
        view = self.hub.slot_views[slot][:nbytes]
        ev = self.release_events[slot]
        try:
            pg = self.pg
            if self.staging is not None:  # gloo from CUDA: the bytes go from pinned host memory
                self.completer.post(ev, partial(pg.send, [self._stage(slot, view)], 1, slot), seq)
            elif self.stream is not None:
                nccl_transfer(ev, self.stream, self.hub.ready_events[slot], partial(pg.send, [view], 1, slot))
                self.completer.add(ev, None, seq)
            else:
                self.completer.post(ev, partial(pg.send, [view], 1, slot), seq)
        except Exception as exc:  # noqa: BLE001 (a failed send is a lost edge)
            self.fail(f"send failed: {exc}")

    def _stage(self, slot: int, view: torch.Tensor) -> torch.Tensor:
        """Copy an item (after its ready event) into the slot's pinned host buffer, and
        wait for the copy: gloo reads the buffer from its own threads."""
        assert self.staging is not None
        host = staged(self.staging, slot, self.hub.slot_views[slot].numel(), view.numel())
        with torch.cuda.stream(self.stream):
            self.hub.ready_events[slot].wait(self.stream)
            host.copy_(view, non_blocking=True)
        self.stream.synchronize()
        return host

    def to_confirm(self) -> int | None:
        """The seq of the SENT to send now (invariant 7), or None."""
        return self.ledger.to_confirm() if self.broken is None else None

    def fail(self, why: str) -> None:
        self.ledger.close()  # (before `broken`, which the completion thread reads)
        if self.broken is None:
            self.broken = why
            log.warning("ipcsync producer %r: remote edge to %s failed: %s", self.hub.name, self.label, why)
        self.close(LOST_JOIN_S)

    def drop(self) -> None:
        """The consumer left the table (under the endpoint's lock): close, and wait only
        ``LOST_JOIN_S`` for the completion thread."""
        self.close(LOST_JOIN_S)

    def close(self, join: float = CLOSE_JOIN_S) -> None:
        """Abort the group if anything is pending (a lost peer), else shut it down, then
        wait up to ``join`` s for the completion thread to end (``LOST_JOIN_S`` from under
        the endpoint's lock: the peer left the table). Nothing is confirmed from here on
        (invariant 7)."""
        self.ledger.close()
        with self._built:
            self.closed = True
        self.store.cancel()  # a join under way ends now (its thread, its half-made group)
        completer = self.completer
        if completer is not None:
            completer.stop()
        pg, self.pg = self.pg, None
        if pg is None:
            return
        clean = self.broken is None and all(e.query() for e in self.release_events)
        self.broken = self.broken or "closed"
        shut_down_or_abort(pg, clean, keep=(self.hub.slot_views, self.staging))
        if completer is not None:
            completer.join(join)
